//! Quiesce and swap: requests submitted while a device is quiesced wait, then
//! complete on the new image, in order, nothing lost; every engine configuration.

use std::time::Duration;

use super::*;

#[test]
fn requests_held_by_a_quiesce_complete_on_the_new_image() {
    for (name, cfg) in configs() {
        let rig = Rig::new(&format!("swap-{name}"), 4 << 20, false, &cfg);
        assert!(rig.run(vec![write(0, pattern(1, 65536), 0)]).iter().all(|r| r.error.is_none()), "{name}");
        let guard = rig.dev.quiesce(Duration::from_secs(5)).unwrap();
        // Queued and inline submissions alike wait in the queue: none completes yet.
        let held = vec![
            write(1 << 20, pattern(2, 65536), 0),
            Request::new(Op::Flush, 0, 0, 1),
            write(1 << 20, pattern(3, 4096), 2),
            Request::new(Op::Read, 0, 65536, 3),
        ];
        rig.dev.submit(held, &rig.sink);
        let mut inline_done = Vec::new();
        rig.dev.submit_inline(vec![write(2 << 20, pattern(4, 4096), 4)], &rig.sink, &mut inline_done);
        assert!(inline_done.is_empty(), "{name}: the inline path ran while quiesced");
        assert!(rig.rx.recv_timeout(Duration::from_millis(100)).is_err(), "{name}: a request ran while quiesced");
        guard.flush().unwrap();
        let overlay = rig.dir.join("top.cow");
        let _ = std::fs::remove_file(&overlay);
        CowImage::create(&overlay, &rig.dir.join("disk.img")).unwrap();
        let top = Arc::new(CowImage::open(&overlay, false, None, false).unwrap());
        guard.replace_image(top).unwrap();
        assert_eq!(rig.dev.image().format(), "cow", "{name}");
        drop(guard);
        let mut done: Vec<Request> = (0..5).map(|_| rig.rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        done.sort_by_key(|r| r.tag);
        assert!(
            done.iter().all(|r| r.error.is_none()),
            "{name}: {:?}",
            done.iter().map(|r| &r.error).collect::<Vec<_>>()
        );
        assert_eq!(done[3].buf(), &pattern(1, 65536)[..], "{name}: the old data, read through the new top");
        // The held writes went to the overlay, in order (the later 4 KiB over the earlier 64 KiB).
        let mut expect = pattern(2, 65536);
        expect[..4096].copy_from_slice(&pattern(3, 4096));
        let back = rig.run(vec![Request::new(Op::Read, 1 << 20, 65536, 0), Request::new(Op::Read, 2 << 20, 4096, 1)]);
        assert_eq!(back[0].buf(), &expect[..], "{name}");
        assert_eq!(back[1].buf(), &pattern(4, 4096)[..], "{name}");
        let base = std::fs::read(rig.dir.join("disk.img")).unwrap();
        assert!(base[1 << 20..(1 << 20) + 65536].iter().all(|&b| b == 0), "{name}: a held write reached the old image");
        assert!(rig.run_inline(vec![write(3 << 20, pattern(5, 4096), 0)])[0].error.is_none(), "{name}");
        rig.dev.shutdown().unwrap();
    }
}

#[test]
fn a_swap_cannot_change_the_size() {
    let rig = Rig::new("swap-size", 1 << 20, false, &EngineConfig::default());
    let other = rig.dir.join("other.img");
    let _ = std::fs::remove_file(&other);
    RawImage::create(&other, 2 << 20, None).unwrap();
    let guard = rig.dev.quiesce(Duration::from_secs(5)).unwrap();
    let e = guard.replace_image(Arc::new(RawImage::open(&other, false).unwrap())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    drop(guard);
    assert!(rig.run(vec![write(0, pattern(1, 4096), 0)])[0].error.is_none());
    rig.dev.shutdown().unwrap();
}

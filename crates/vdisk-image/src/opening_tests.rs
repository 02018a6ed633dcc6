//! Unit tests of the factory: detection, forced formats, a backing chain
//! across formats, refusals, and RBD names (parsed, no cluster needed).

use std::os::unix::fs::FileExt;

use super::*;
use crate::qcow2::{CreateOptions, DEFAULT_CLUSTER_BITS};
use crate::testing::read;
use crate::ErrorKind;

const SIZE: u64 = 1 << 20;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vdisk-opening-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A raw base of [`SIZE`] bytes holding `fill` in its first sector.
fn raw(d: &Path, fill: u8) -> PathBuf {
    let p = d.join("base.img");
    RawImage::create(&p, SIZE, None).unwrap();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().write_all_at(&[fill; 512], 0).unwrap();
    p
}

fn qcow2_over(p: &Path, backing: Option<(&Path, &str)>) {
    Qcow2Image::create(p, &CreateOptions { size: SIZE, cluster_bits: DEFAULT_CLUSTER_BITS, backing }).unwrap();
}

fn ro() -> OpenOptions {
    OpenOptions { read_only: true, ..Default::default() }
}

#[test]
fn each_format_is_detected_and_opened_as_itself() {
    let d = dir("detect");
    let base = raw(&d, 1);
    let cow = d.join("over.cow");
    CowImage::create(&cow, &base).unwrap();
    let q = d.join("plain.qcow2");
    qcow2_over(&q, None);
    let empty = d.join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    for (p, format) in [(&base, Format::Raw), (&cow, Format::Cow), (&q, Format::Qcow2), (&empty, Format::Raw)] {
        assert_eq!(detect(p).unwrap(), format, "{p:?}");
        let opened = open(p, &ro()).unwrap();
        assert_eq!(opened.format, format, "{p:?}");
        assert_eq!(opened.image.format(), format.name());
        assert_eq!(opened.target, Target::File(p.clone()));
    }
    let o = open(&cow, &ro()).unwrap();
    assert_eq!(o.backing.map(|b| b.format), Some(Format::Raw));
    assert_eq!(read(&*o.image, 0, 512), vec![1u8; 512], "the overlay reads through to its base");
    assert!(open(&q, &ro()).unwrap().backing.is_none());
    assert_eq!(detect(Path::new("rbd:pool/image")).unwrap(), Format::Rbd);
    let e = detect(&d.join("missing.img")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn format_raw_serves_an_overlay_as_its_own_bytes() {
    let d = dir("forced");
    let base = raw(&d, 1);
    let cow = d.join("over.cow");
    CowImage::create(&cow, &base).unwrap();
    let opened = open(&cow, &OpenOptions { format: Some(Format::Raw), ..ro() }).unwrap();
    assert_eq!(opened.format, Format::Raw);
    assert_eq!(opened.image.size(), std::fs::metadata(&cow).unwrap().len(), "the file's size, not the disk's");
    assert!(cow::has_magic(&read(&*opened.image, 0, 4)), "the header is served as data");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_qcow2_over_a_cow_overlay_over_a_raw_file() {
    let d = dir("chain");
    let base = raw(&d, 7);
    let cow = d.join("mid.cow");
    CowImage::create(&cow, &base).unwrap();
    // Once with the backing format recorded, once without: then it is probed.
    for (name, recorded) in [("named.qcow2", true), ("probed.qcow2", false)] {
        let q = d.join(name);
        qcow2_over(&q, Some((&cow, "cow")));
        if !recorded {
            unname_backing_format(&q);
        }
        let opened = open(&q, &ro()).unwrap();
        assert_eq!(opened.format, Format::Qcow2);
        let backing = opened.backing.expect("a backing");
        assert_eq!(backing.format, Format::Cow, "{name}");
        assert_eq!(backing.name, cow.canonicalize().unwrap());
        assert_eq!(read(&*opened.image, 0, 512), vec![7u8; 512], "{name}: the raw base's data, two links down");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Turns the backing format extension of the qcow2 image at `p` into an
/// unknown one (which readers skip), as an image made without `-F` has none.
fn unname_backing_format(p: &Path) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(p).unwrap();
    let mut head = vec![0u8; 4096];
    f.read_exact_at(&mut head, 0).unwrap();
    let at = head.windows(4).position(|w| w == 0xE279_2ACAu32.to_be_bytes()).expect("a backing format extension");
    f.write_all_at(&0x0bad_cafeu32.to_be_bytes(), at as u64).unwrap();
    f.read_exact_at(&mut head, 0).unwrap();
    let h = qcow2::parse_header(&head).unwrap();
    assert_eq!(h.backing_format, None);
}

#[test]
fn a_format_or_option_that_does_not_fit_is_refused() {
    let d = dir("refused");
    let base = raw(&d, 0);
    let q = d.join("plain.qcow2");
    qcow2_over(&q, None);
    let refused = |p: &Path, o: OpenOptions, says: &str| {
        let e = open(p, &o).err().expect("refused").to_string();
        assert!(e.contains(&p.display().to_string()) && e.contains(says), "{e}");
    };
    refused(&base, OpenOptions { format: Some(Format::Qcow2), ..ro() }, "not a qcow2 image");
    refused(&base, OpenOptions { format: Some(Format::Cow), ..ro() }, "not a COW overlay");
    refused(&base, OpenOptions { format: Some(Format::Rbd), ..ro() }, "rbd:POOL/IMAGE");
    refused(&base, OpenOptions { backing: Some(q.clone()), ..ro() }, "is a raw image");
    refused(&q, OpenOptions { ignore_backing_mtime: true, ..ro() }, "COW overlays only");
    refused(&q, OpenOptions { backing: Some(base.clone()), ..ro() }, "no backing file to replace");
    let rbd = Path::new("rbd:pool/disk@snap");
    for o in [
        OpenOptions { format: Some(Format::Qcow2), ..ro() },
        OpenOptions { backing: Some(base.clone()), ..ro() },
        OpenOptions { direct: true, ..ro() },
    ] {
        let e = open(rbd, &o).err().expect("refused before any cluster is reached").to_string();
        assert!(e.contains("rbd:pool/disk@snap is an RBD image"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn rbd_names_are_parsed_here() {
    let defaults = ConnectOptions { conf: Some("/etc/ceph/other.conf".into()), id: None, extra: Vec::new() };
    let t = Target::parse(Path::new("rbd:pool/disk@snap:id=backup"), &defaults).unwrap();
    let Target::Rbd(spec) = &t else { panic!("{t:?}") };
    assert_eq!((spec.pool.as_str(), spec.image.as_str(), spec.snap.as_deref()), ("pool", "disk", Some("snap")));
    assert_eq!(spec.options.conf.as_deref(), Some(Path::new("/etc/ceph/other.conf")), "the default applies");
    assert_eq!(spec.options.id.as_deref(), Some("backup"), "the name's own option wins");
    assert_eq!(t.export_name().as_deref(), Some("disk@snap"));
    assert_eq!(t.to_string(), spec.to_string());
    let f = Target::parse(Path::new("/srv/disks/web.qcow2"), &defaults).unwrap();
    assert_eq!(f, Target::File("/srv/disks/web.qcow2".into()));
    assert_eq!(f.export_name().as_deref(), Some("web"));
    let e = Target::parse(Path::new("rbd:no-image"), &defaults).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert_eq!(Format::from_name("qcow2"), Some(Format::Qcow2));
    assert_eq!(Format::from_name("vmdk"), None);
}

#[test]
fn with_roots_the_image_and_its_chain_stay_beneath_them() {
    let d = dir("roots");
    let root = d.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let outside = raw(&d, 5);
    let inside = root.join("in.img");
    std::fs::copy(&outside, &inside).unwrap();
    let over_out = root.join("out.qcow2");
    qcow2_over(&over_out, Some((&outside, "raw")));
    let over_in = root.join("in.qcow2");
    qcow2_over(&over_in, Some((&inside, "raw")));
    let roots = Some(Arc::new(Roots::open(std::slice::from_ref(&root)).unwrap()));
    let confined = OpenOptions { roots, ..ro() };
    assert_eq!(read(&*open(&over_in, &confined).unwrap().image, 0, 512), vec![5u8; 512]);
    for p in [&outside, &over_out] {
        let e = open(p, &confined).err().expect("refused").to_string();
        assert!(e.contains("outside the image roots"), "{p:?}: {e}");
    }
    assert!(open(&over_out, &ro()).is_ok(), "unconfined, the same chain opens");
    let _ = std::fs::remove_dir_all(&d);
}

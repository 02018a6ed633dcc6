//! The UML kernel itself reads the overlays vdisk writes: the format's
//! reference consumer. Debian's user-mode-linux boots with the overlay as a
//! read-only ubd disk (`ubd0r=OVERLAY,BASE`), the host's root as a read-only
//! hostfs root, and an init script that copies /dev/ubda into a host file
//! and powers off. That copy must equal `vdisk commit`'s and `uml_moo`'s
//! merges byte for byte. (Before overlays were filled in whole 4 KiB pages,
//! UML read 5000 bytes written at offset 1000 as if they went on to 32768.)
//!
//! A missing `linux` binary fails (scripts/install-test-deps.sh installs
//! it). On some hosts UML cannot run at all: it panics at init with "ptrace
//! set fp regs failed" (the host's ptrace does not let it set a child's FPU
//! state); there, and only there, the test says so and skips.

mod common;

use common::{assert_same, make_base, qemu_io, read_file, run, s, text, vdisk, Server, TempDir, KIB, MIB};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What UML prints when the host will not run it (see the module docs).
const HOST_CANNOT_RUN_UML: &str = "ptrace set fp regs failed";
/// Boot, copy and power-off take about 1.5 s here; headroom for a loaded machine.
const BOOT_LIMIT: Duration = Duration::from_secs(180);

/// Boots the UML kernel on `overlay` over `base` (read-only) and returns the
/// disk as it read it, or None when the host cannot run UML at all.
fn read_under_uml(dir: &TempDir, overlay: &Path, base: &Path) -> Option<Vec<u8>> {
    let d = s(&dir.0);
    let out = dir.path("uml.img");
    let script = dir.path("init.sh");
    // Inside UML the host's / is the root, read-only; the test directory is
    // mounted again (hostfs, writable) so the copy can land there.
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             mount -t hostfs -o {d} none {d} || echo 'uml-test: cannot mount hostfs {d}'\n\
             dd if=/dev/ubda of={out} bs=1M 2>{d}/dd.log\n\
             echo $? > {d}/dd.rc\n\
             sync\n\
             poweroff -f || halt -f\n",
            out = s(&out)
        ),
    )
    .unwrap();
    run("chmod", &["+x", s(&script)]);
    let log_path = dir.path("uml.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let uml_dir = dir.path("uml-dir");
    std::fs::create_dir_all(&uml_dir).unwrap();
    let mut child = Command::new("linux")
        .arg(format!("ubd0r={},{}", s(overlay), s(base)))
        .args(["root=/dev/root", "rootfstype=hostfs", "rootflags=/", "mem=64M", "con=null", "con0=fd:0,fd:1"])
        .arg(format!("init={}", s(&script)))
        // Its mconsole socket and pid file stay in the test directory.
        .arg(format!("uml_dir={}", s(&uml_dir)))
        .arg(format!("umid=vdisk-test-{}", std::process::id()))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        // Its own group: UML runs each guest process as a host process, and a
        // stuck boot is ended by killing the whole group (only what this test started).
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run linux (the UML kernel): {e}; install user-mode-linux"));
    let kill_all = |child: &mut std::process::Child| {
        // SAFETY: kill only reads its integer arguments; the group is the one spawned above.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    };
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        let so_far = String::from_utf8_lossy(&read_file(&log_path)).into_owned();
        if so_far.contains(HOST_CANNOT_RUN_UML) {
            kill_all(&mut child);
            break child.wait().unwrap();
        }
        if start.elapsed() > BOOT_LIMIT {
            kill_all(&mut child);
            panic!("the UML kernel did not finish within {BOOT_LIMIT:?}; its output:\n{so_far}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = String::from_utf8_lossy(&read_file(&log_path)).into_owned();
    if log.contains(HOST_CANNOT_RUN_UML) {
        eprintln!(
            "SKIPPED: this host cannot run the UML kernel: it panics at init with \"{HOST_CANNOT_RUN_UML}\" \
             (the host's ptrace will not set a traced process's FPU registers); the overlay was not read under UML"
        );
        return None;
    }
    let rc = std::fs::read_to_string(dir.path("dd.rc")).unwrap_or_default();
    let dd = std::fs::read_to_string(dir.path("dd.log")).unwrap_or_default();
    assert_eq!(
        rc.trim(),
        "0",
        "dd of /dev/ubda under UML did not succeed (UML exited with {status}).\ndd: {dd}\nUML's output:\n{log}"
    );
    eprintln!("the UML kernel booted and read the overlay in {:.1?}", start.elapsed());
    Some(read_file(&out))
}

#[test]
fn the_uml_kernel_reads_an_overlay_vdisk_wrote_as_commit_and_uml_moo_do() {
    let dir = TempDir::new("uml");
    let base = dir.path("base.img");
    let mut model = make_base(&base, 4 * MIB, 0x0dd_0c0e);
    let overlay = dir.path("vm.cow");
    let out = vdisk(&["create", "--backing", s(&base), s(&overlay)]);
    assert!(out.status.success(), "{}", text(&out));

    // Unaligned writes: the 5000 bytes at 1000, across a page
    // boundary, one sector of a fresh page, a long run, zeroes, FUA, the end.
    let writes: [(usize, usize, &str); 8] = [
        (1000, 5000, "-P 0xaa"),
        (8192 + 4095, 2, "-P 0x11"),
        (65536 + 512, 512, "-P 0x22"),
        (MIB - 1, 3, "-P 0x33"),
        (MIB + 100, 64 * KIB, "-P 0x44"),
        (2 * MIB + 100, 5000, "-z -u"),
        (3 * MIB + 3000, 100, "-f -P 0x55"),
        (4 * MIB - 2000, 2000, "-P 0x66"),
    ];
    let mut cmds = Vec::new();
    for (off, len, how) in writes {
        let fill = how.rsplit_once("0x").map_or(0, |(_, h)| u8::from_str_radix(h, 16).unwrap());
        model[off..off + len].fill(fill);
        cmds.push(format!("write {how} {off} {len}"));
    }
    cmds.push("flush".into());
    let server = Server::start(&dir, &[s(&overlay)]);
    qemu_io(&server.uri("vm"), &cmds);
    server.stop();

    let by_vdisk = dir.path("commit.img");
    let out = vdisk(&["commit", s(&overlay), "--into", s(&by_vdisk)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_same("vdisk commit", &read_file(&by_vdisk), &model);
    let by_moo = dir.path("moo.img");
    run("uml_moo", &[s(&overlay), s(&by_moo)]);
    assert_same("uml_moo", &read_file(&by_moo), &model);

    let Some(by_uml) = read_under_uml(&dir, &overlay, &base) else { return };
    assert_same("the UML kernel's read vs vdisk commit", &by_uml, &read_file(&by_vdisk));
    assert_same("the UML kernel's read vs uml_moo", &by_uml, &read_file(&by_moo));
}

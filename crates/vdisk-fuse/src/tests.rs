//! The panic edge of the classic transport, without a mount: a reader serves
//! a SOCK_SEQPACKET socket standing in for /dev/fuse (one request per read,
//! like the device), over a real device on a raw file. A request whose
//! dispatch panics gets EIO and the next ones are served; after the loop
//! itself panics, every request still gets an answer (EIO), never silence;
//! a submit that panics answers its batch EIO and leaves no request counted
//! in flight (else a stop would wait out its limit).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use vdisk_engine::{Device, EngineConfig};
use vdisk_image::{Image, RawImage};

use crate::classic::Reader;
use crate::proto::{self, Wire};
use crate::session::{Session, TEST_PANIC, TEST_PANIC_IN_LOOP, TEST_PANIC_SUBMIT_AT};

struct Kernel {
    fd: OwnedFd,
    dir: std::path::PathBuf,
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Kernel {
    fn send(&self, opcode: u32, unique: u64, arg: &[u8]) {
        let h = proto::InHeader { len: (40 + arg.len()) as u32, opcode, unique, nodeid: 1, ..Default::default() };
        let mut msg = h.bytes().to_vec();
        msg.extend_from_slice(arg);
        // SAFETY: msg is a live buffer of msg.len() bytes; the kernel only reads it.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
        assert_eq!(n, msg.len() as isize, "sending request {unique}");
    }

    /// The next reply: (unique, errno, body length); panics after 10 s of silence.
    fn reply(&self) -> (u64, i32, usize) {
        let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut p, 1, 10_000) };
        assert_eq!(ready, 1, "no reply within 10 s: a request was left unanswered");
        let mut buf = vec![0u8; 2 << 20];
        // SAFETY: buf is ours and writable for its length.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        assert!(n >= 16, "reply of {n} bytes");
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        let error = i32::from_ne_bytes(buf[4..8].try_into().unwrap());
        let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
        assert_eq!(len, n as usize, "reply length field");
        (unique, -error, len - 16)
    }
}

fn serve(tag: &str) -> (Kernel, std::thread::JoinHandle<()>) {
    let (k, t, _) = serve_session(tag);
    (k, t)
}

/// [`serve`], with the session (its in-flight count) kept for the test.
fn serve_session(tag: &str) -> (Kernel, std::thread::JoinHandle<()>, Arc<Session>) {
    let dir = std::env::temp_dir().join(format!("vdisk-fuse-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    let _ = std::fs::remove_file(&path);
    RawImage::create(&path, 1 << 20, None).unwrap();
    let image: Arc<dyn Image> = Arc::new(RawImage::open(&path, false).unwrap());
    let device = Arc::new(Device::start(tag, image, &EngineConfig::default()).unwrap());
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two new descriptors into the array.
    let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) };
    assert_eq!(r, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: fds[0] was just created and is owned by nobody else.
    let server = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: the same for fds[1].
    let kernel = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    let session = Arc::new(Session::new(device));
    let reader = Reader::new(server, session.clone()).unwrap();
    (Kernel { fd: kernel, dir }, std::thread::spawn(move || reader.run()), session)
}

fn read_arg(offset: u64, size: u32) -> Vec<u8> {
    proto::RwIn { offset, size, ..Default::default() }.bytes().to_vec()
}

#[test]
fn a_panicking_request_gets_eio_and_the_next_ones_are_served() {
    let (k, t) = serve("panic-request");
    k.send(TEST_PANIC, 7, &[]);
    assert_eq!(k.reply(), (7, libc::EIO, 0));
    k.send(proto::GETATTR, 8, &[]);
    let (unique, errno, _) = k.reply();
    assert_eq!((unique, errno), (8, 0), "GETATTR after the panic");
    k.send(proto::READ, 9, &read_arg(4096, 8192));
    assert_eq!(k.reply(), (9, 0, 8192), "a READ through the engine after the panic");
    drop(k);
    t.join().expect("the reader thread ends when the device goes away");
}

#[test]
fn after_the_loop_itself_panics_every_request_still_gets_eio() {
    let (k, t) = serve("panic-loop");
    k.send(proto::GETATTR, 1, &[]);
    assert_eq!(k.reply().1, 0);
    k.send(TEST_PANIC_IN_LOOP, 2, &[]);
    assert_eq!(k.reply(), (2, libc::EIO, 0), "the request the loop panicked on");
    for unique in 3..6 {
        k.send(proto::READ, unique, &read_arg(0, 4096));
        assert_eq!(k.reply(), (unique, libc::EIO, 0), "request {unique} after the loop failed");
    }
    drop(k);
    t.join().expect("the reader thread ends when the device goes away");
}

extern "C" fn ignore(_: libc::c_int) {}

/// A real signal, with a handler installed without SA_RESTART, delivered
/// again and again to the reader while it waits in poll(2) and reads
/// /dev/fuse (here its stand-in): each call fails with EINTR, and the
/// reader must wait again, not end or drop a request.
#[test]
fn signals_without_sa_restart_do_not_stop_the_reader() {
    use std::os::unix::thread::JoinHandleExt;
    // SAFETY: sigaction is plain data; all zero is a valid (empty) value.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = ignore as *const () as usize;
    sa.sa_flags = 0; // no SA_RESTART: blocked calls fail with EINTR
                     // SAFETY: installs a handler that does nothing for SIGURG (ignored by
                     // default, used by no one else in this test binary); sa is fully set.
    assert_eq!(unsafe { libc::sigaction(libc::SIGURG, &sa, std::ptr::null_mut()) }, 0);
    let (k, t) = serve("eintr");
    for unique in 1..=5u64 {
        for _ in 0..20 {
            // SAFETY: the thread is alive (joined only below); SIGURG has a handler.
            unsafe { libc::pthread_kill(t.as_pthread_t(), libc::SIGURG) };
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        k.send(proto::READ, unique, &read_arg(0, 4096));
        assert_eq!(k.reply(), (unique, 0, 4096), "READ {unique} after signals");
    }
    drop(k);
    t.join().expect("the reader thread ends when the device goes away");
}

/// The ring transport's panic edges, mounted for real (root, and the kernel's
/// FUSE-over-io_uring): a READ whose dispatch panics gets EIO and the queue
/// serves on; after the queue's loop itself panics, the request it held and
/// every later one on that queue get EIO, never silence. The thread is pinned
/// to one CPU so that every request goes to the same queue.
#[test]
fn ring_requests_that_panic_get_eio_and_the_queue_goes_on() {
    use std::os::unix::fs::FileExt;

    use crate::session::{TEST_PANIC_LOOP_AT, TEST_PANIC_READ_AT};
    const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";
    if !std::path::Path::new(PARAM).exists() {
        println!("skipped: this kernel has no FUSE-over-io_uring ({PARAM} is missing)");
        return;
    }
    std::fs::write(PARAM, "Y").expect("turn on FUSE-over-io_uring (the test runs as root)");
    // SAFETY: cpu_set_t is plain data; all zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes into set.
    assert_eq!(unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) }, 0);
    let is_set = |c: usize| {
        // SAFETY: CPU_ISSET only reads the cpu_set_t it is given; c < CPU_SETSIZE.
        unsafe { libc::CPU_ISSET(c, &set) }
    };
    let cpu = (0..libc::CPU_SETSIZE as usize).find(|&c| is_set(c)).expect("some CPU to run on");
    // SAFETY: CPU_ZERO only writes the cpu_set_t it is given.
    unsafe { libc::CPU_ZERO(&mut set) };
    // SAFETY: CPU_SET only writes the cpu_set_t it is given; cpu < CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pins this thread (0) to a CPU it may run on; set is valid for its size.
    assert_eq!(unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) }, 0);

    let dir = std::env::temp_dir().join(format!("vdisk-fuse-{}-ring-panic", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.img");
    let _ = std::fs::remove_file(&img);
    RawImage::create(&img, 1 << 20, None).unwrap();
    let image: Arc<dyn Image> = Arc::new(RawImage::open(&img, false).unwrap());
    let device = Arc::new(Device::start("ring-panic", image, &EngineConfig::default()).unwrap());
    let file = dir.join("disk.file");
    let export = crate::start(&file, device, &crate::Options { uring: true, readers: 1 }).expect("mount with the ring");
    let f = std::fs::File::open(&file).unwrap();
    let mut buf = vec![0u8; 4096];
    let eio = |r: std::io::Result<usize>, what: &str| {
        assert_eq!(r.map_err(|e| e.raw_os_error()), Err(Some(libc::EIO)), "{what}");
    };
    assert_eq!(f.read_at(&mut buf, 0).unwrap(), 4096);
    eio(f.read_at(&mut buf, TEST_PANIC_READ_AT), "the READ whose dispatch panicked");
    assert_eq!(f.read_at(&mut buf, 4096).unwrap(), 4096, "a READ after that panic");
    eio(f.read_at(&mut buf, TEST_PANIC_LOOP_AT), "the READ the loop panicked on");
    for at in [0, 8192, 65536] {
        eio(f.read_at(&mut buf, at), "a READ on the failed queue");
    }
    drop(f);
    export.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_submit_that_panics_answers_eio_and_leaves_nothing_in_flight() {
    let (k, t, session) = serve_session("panic-submit");
    k.send(proto::READ, 1, &read_arg(TEST_PANIC_SUBMIT_AT, 4096));
    assert_eq!(k.reply(), (1, libc::EIO, 0), "the READ whose submit panicked");
    k.send(proto::READ, 2, &read_arg(0, 4096));
    assert_eq!(k.reply(), (2, 0, 4096), "a READ after the panic");
    let idle = session.inflight.wait_idle_timeout(std::time::Duration::from_secs(2));
    assert!(idle, "still counted in flight after every request was answered: {:?}", session.inflight.counts());
    drop(k);
    t.join().expect("the reader thread ends when the device goes away");
}

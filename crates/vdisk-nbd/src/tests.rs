//! The connection's panic edge, on a real server over a unix socket: a
//! connection whose reader panics is closed at once (the client sees the end,
//! never silence) and another client of the same export goes on being served.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::client::{Client, Cmd};
use crate::conn::TEST_PANIC_CMD;
use crate::{fuzzing, Listener, Server, ServerOptions};

/// A server of one 1 MiB export "disk" (the fuzzing image) on a unix socket in
/// a fresh directory named after `tag`: the server, its serving thread, the
/// directory and the socket's path.
fn serve_one_disk(tag: &str) -> (Arc<Server>, JoinHandle<std::io::Result<()>>, PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("vdisk-nbd-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nbd.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let server = Server::new(fuzzing::exports(&[("disk", 1 << 20, false)]), ServerOptions::default()).unwrap();
    let serving = {
        let (server, path) = (server.clone(), path.clone());
        std::thread::spawn(move || server.serve(vec![Listener::Unix(listener, path)]))
    };
    (server, serving, dir, path)
}

#[test]
fn a_panicking_connection_is_closed_and_the_others_serve_on() {
    let (server, serving, dir, path) = serve_one_disk("panic");
    let timeout = Duration::from_secs(20);
    let mut other = Client::connect(&path, "disk", timeout).unwrap();
    let mut victim = Client::connect(&path, "disk", timeout).unwrap();
    victim.send_request(0, TEST_PANIC_CMD, 0, 0, &[]).unwrap();
    let start = Instant::now();
    let mut rest = Vec::new();
    let end = victim.sock.read_to_end(&mut rest);
    let took = start.elapsed();
    assert!(
        !matches!(&end, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "the panicking connection went silent for {took:?} instead of closing"
    );
    assert!(took < Duration::from_secs(5), "closing the panicking connection took {took:?}");
    assert!(rest.is_empty(), "a reply to a request that panicked: {rest:?}");
    // (The fuzzing image holds no data: its reads answer an error, which is an answer.)
    let cookie = other.send(Cmd::Read, 0, 0, 4096, &[]).unwrap();
    let reply = other.recv().expect("the other client is answered after the panic");
    assert_eq!(reply.cookie, cookie);
    let mut again = Client::connect(&path, "disk", timeout).expect("a new client after the panic");
    let cookie = again.send(Cmd::Read, 0, 4096, 512, &[]).unwrap();
    assert_eq!(again.recv().expect("a new connection is answered").cookie, cookie);
    other.disconnect();
    again.disconnect();
    server.stop();
    serving.join().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

extern "C" fn ignore(_: libc::c_int) {}

/// Sends SIGURG to every thread of this process whose name starts with `prefix`.
fn signal_threads(prefix: &str) -> usize {
    let mut hit = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::c_int>() else { continue };
        if comm.trim_end().starts_with(prefix) {
            // SAFETY: tgkill only reads its integer arguments; SIGURG has a handler.
            unsafe { libc::syscall(libc::SYS_tgkill, std::process::id() as libc::c_int, tid, libc::SIGURG) };
            hit += 1;
        }
    }
    hit
}

/// A real signal, with a handler installed without SA_RESTART, delivered
/// again and again to the server's threads (the acceptor in poll, the
/// readers in read, the writers waiting): every blocked call that fails with
/// EINTR is retried, and the clients are served as before.
#[test]
fn signals_without_sa_restart_do_not_break_connections() {
    // SAFETY: sigaction is plain data; all zero is a valid (empty) value.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = ignore as *const () as usize;
    sa.sa_flags = 0; // no SA_RESTART: blocked calls fail with EINTR
                     // SAFETY: a handler that does nothing for SIGURG, which nothing else here uses.
    assert_eq!(unsafe { libc::sigaction(libc::SIGURG, &sa, std::ptr::null_mut()) }, 0);
    let (server, serving, dir, path) = serve_one_disk("eintr");
    let timeout = Duration::from_secs(20);
    let mut clients: Vec<Client> = (0..3).map(|_| Client::connect(&path, "disk", timeout).unwrap()).collect();
    for round in 0..20 {
        // The acceptor, and a reader and a writer per client.
        let hit = signal_threads("nbd-");
        assert!(hit > 2 * clients.len(), "round {round}: signalled only {hit} threads");
        std::thread::sleep(Duration::from_millis(5));
        for c in &mut clients {
            let cookie = c.send(Cmd::Read, 0, 512 * round, 512, &[]).unwrap();
            assert_eq!(c.recv().expect("answered after signals").cookie, cookie, "round {round}");
        }
    }
    // The acceptor, signalled as often, still takes new clients.
    let mut late = Client::connect(&path, "disk", timeout).expect("a new client after the signals");
    let cookie = late.send(Cmd::Read, 0, 0, 512, &[]).unwrap();
    assert_eq!(late.recv().unwrap().cookie, cookie);
    for c in clients {
        c.disconnect();
    }
    late.disconnect();
    server.stop();
    serving.join().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

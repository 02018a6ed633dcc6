//! The connection's panic edge, on a real server over a unix socket: a
//! connection whose reader panics is closed at once (the client sees the end,
//! never silence) and another client of the same export goes on being served.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use crate::client::{Client, Cmd};
use crate::conn::TEST_PANIC_CMD;
use crate::{fuzzing, Listener, Server, ServerOptions};

#[test]
fn a_panicking_connection_is_closed_and_the_others_serve_on() {
    let dir = std::env::temp_dir().join(format!("vdisk-nbd-{}-panic", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nbd.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let server = Server::new(fuzzing::exports(&[("disk", 1 << 20, false)]), ServerOptions::default()).unwrap();
    let serving = {
        let (server, path) = (server.clone(), path.clone());
        std::thread::spawn(move || server.serve(vec![Listener::Unix(listener, path)]))
    };
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

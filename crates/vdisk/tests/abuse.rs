//! Hostile clients at scale, over the raw client of `common::nbd`: 10,000
//! connections opened and dropped in every state (fds and threads return to
//! where they were), clients that never read their replies (the server's
//! memory stays bounded per connection, measured in /proc/PID/status), options
//! whose lengths lie, and requests of every size up to the 32 MiB maximum.

mod common;

use common::nbd::*;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// (open fds, threads) of process `pid`. io_uring's kernel workers
/// (`iou-wrk-*`, `iou-sqp-*`) are not counted: the kernel starts them on
/// demand and retires them on its own timer, so they say nothing of leaks.
fn resources(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd").count();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("read /proc/PID/task")
        .map_while(Result::ok)
        .filter(|t| !std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().starts_with("iou-"))
        .count();
    (fds, threads)
}

/// Thread names of process `pid`, for failure messages.
fn thread_names(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map_while(Result::ok)
        .map(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().trim().to_owned())
        .collect();
    v.sort();
    v
}

fn fd_listing(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .map_while(Result::ok)
        .map(|e| format!("{} -> {:?}", e.file_name().to_string_lossy(), std::fs::read_link(e.path()).ok()))
        .collect();
    v.sort();
    v
}

/// Polls until two samples 50 ms apart agree (at most 2 s).
fn settled_resources(pid: u32) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut last = resources(pid);
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = resources(pid);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// One connection of the leak test, abandoned in one of several ways.
fn abandoned_connection(sock: &Path, kind: usize) {
    match kind {
        // Before reading the greeting.
        0 => drop(UnixStream::connect(sock).unwrap()),
        // Mid-handshake: client flags, half an option header.
        1 => {
            let mut c = Client::handshake(sock);
            c.send(&IHAVEOPT.to_be_bytes()[..5]);
        }
        // After GO, in the middle of a WRITE's payload.
        2 => {
            let (mut c, _) = Client::open(sock, "disk");
            c.send_request(0, CMD_WRITE, 0, 64 * KIB as u32, &[7; 1000]);
        }
        // After GO, with a READ whose reply is never read.
        3 => {
            let (mut c, _) = Client::open(sock, "disk");
            c.send_request(0, CMD_READ, 0, MIB as u32, &[]);
        }
        // A reply left unread, then a WRITE and half of a large WRITE's
        // payload: closing with unread data resets the connection, so the
        // server's read of that payload fails (ECONNRESET, not end of file)
        // with the first WRITE received but not yet answered.
        4 => {
            let (mut c, _) = Client::open(sock, "disk");
            c.send_request(0, CMD_READ, 0, 4096, &[]);
            let mut byte = 0u8;
            // SAFETY: recv writes at most one byte into `byte`, which outlives the call.
            let n = unsafe { libc::recv(c.sock.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK) };
            assert_eq!(n, 1, "the READ's reply did not come");
            let (_, mut msg) = c.encode_request(0, CMD_WRITE, 0, 4096, &[3; 4096]);
            msg.extend_from_slice(&c.encode_request(0, CMD_WRITE, 0, MIB as u32, &[4; 1000]).1);
            c.send(&msg);
        }
        // A normal session.
        _ => {
            let (mut c, _) = Client::open(sock, "disk");
            c.write(8192, &[1; 512], 0);
            c.read(8192, 512);
            c.disconnect();
        }
    }
}

#[test]
fn ten_thousand_connections_leave_no_fds_or_threads_behind() {
    const CONNECTIONS: usize = 10_000;
    const CLIENTS: usize = 8;
    let fx = Fixture::new("10k", &[]);
    let pid = fx.server.child.id();

    let (mut warm, _) = Client::open(fx.sock(), "disk");
    warm.write(0, &[1; 4096], 0);
    warm.read(0, 4096);
    warm.disconnect();
    let (base_fds, base_threads) = settled_resources(pid);
    let (base_fd_list, base_thread_list) = (fd_listing(pid), thread_names(pid));

    // Eight clients at once, each abandoning its connections in every way in
    // turn; every tenth one also keeps a connection idle in mid-negotiation
    // until its batch of 100 is done.
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..CLIENTS {
            let sock = fx.sock();
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..CONNECTIONS / CLIENTS {
                    abandoned_connection(sock, (t + i) % 6);
                    if i % 10 == 0 {
                        held.push(Client::handshake(sock));
                    }
                    if i % 100 == 99 {
                        held.clear();
                    }
                }
            });
        }
    });
    let took = started.elapsed();

    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut fds, mut threads) = resources(pid);
    while (fds > base_fds || threads > base_threads) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        (fds, threads) = resources(pid);
    }
    assert!(
        fds <= base_fds && threads <= base_threads,
        "after {CONNECTIONS} connections: {fds} fds / {threads} threads, baseline {base_fds} / {base_threads}\n\
         fds then: {base_fd_list:#?}\nfds now: {:#?}\nthreads then: {base_thread_list:?}\nthreads now: {:?}",
        fd_listing(pid),
        thread_names(pid),
    );
    eprintln!("{CONNECTIONS} connections opened and dropped in {took:?}; {fds} fds, {threads} threads as before");
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

/// VmRSS of `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS in /proc/PID/status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn clients_that_never_read_their_replies_cost_bounded_memory() {
    // Each hog sends 32 MiB READs and 8 MiB WRITEs and never reads a byte
    // back. The server may hold 64 MiB of request data in flight per
    // connection; past that it stops reading from that client. Whatever the
    // hogs push, the server's RSS must stay below 64 MiB plus slack each.
    const HOGS: u64 = 3;
    const PER_CONNECTION: u64 = 64 * MIB;
    const SLACK: u64 = 48 * MIB;
    let fx = Fixture::with_images("hog", &[("disk", "64M")], &[]);
    let pid = fx.server.child.id();
    let (mut warm, _) = Client::open(fx.sock(), "disk");
    warm.write(0, &pattern(1, 8 * MIB as usize), 0);
    warm.disconnect();
    std::thread::sleep(Duration::from_millis(200));
    let base = rss(pid);

    let write = pattern(2, 8 * MIB as usize);
    let mut hogs = Vec::new();
    let mut pushers = Vec::new();
    for _ in 0..HOGS {
        let (mut c, _) = Client::open(fx.sock(), "disk");
        let mut burst = Vec::new();
        for i in 0..4u64 {
            burst.extend_from_slice(&c.encode_request(0, CMD_READ, 0, MAX_PAYLOAD, &[]).1);
            burst.extend_from_slice(&c.encode_request(0, CMD_WRITE, (4 + i) * 8 * MIB, write.len() as u32, &write).1);
        }
        let mut sock = c.sock.try_clone().unwrap();
        sock.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
        // Pushes until the server stops reading (the write blocks) and then
        // until the socket is shut down.
        pushers.push(std::thread::spawn(move || {
            use std::io::Write;
            let mut sent = 0u64;
            loop {
                let at = (sent % burst.len() as u64) as usize;
                match sock.write(&burst[at..(at + 256 * 1024).min(burst.len())]) {
                    Ok(n) if n > 0 => sent += n as u64,
                    _ => return sent,
                }
            }
        }));
        hogs.push(c);
    }
    let mut peak = base;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        peak = peak.max(rss(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Meanwhile a well-behaved client is served as usual.
    let (mut c, _) = Client::open(fx.sock(), "disk");
    assert_eq!(c.read(0, 4096), pattern(1, 4096), "a polite client beside the hogs");
    c.disconnect();
    peak = peak.max(rss(pid));
    // Every hog is stuck in a write: the server stopped reading from it.
    assert!(pushers.iter().all(|p| !p.is_finished()), "a hog's pushing ended before the server stopped reading");
    for h in &hogs {
        h.sock.shutdown(std::net::Shutdown::Both).unwrap();
    }
    let pushed: u64 = pushers.into_iter().map(|p| p.join().unwrap()).sum();
    let grew = peak.saturating_sub(base);
    eprintln!(
        "{HOGS} hogs got {} MiB of requests read before the server stopped reading; server RSS {} MiB at rest, peak {} MiB (+{} MiB)",
        pushed / MIB,
        base / MIB,
        peak / MIB,
        grew / MIB
    );
    assert!(
        grew < HOGS * (PER_CONNECTION + SLACK),
        "server RSS grew by {} MiB with {HOGS} clients that never read (bound: {} MiB)",
        grew / MIB,
        HOGS * (PER_CONNECTION + SLACK) / MIB
    );
    drop(hogs);
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn options_whose_lengths_lie_are_invalid_and_negotiation_goes_on() {
    let fx = Fixture::new("lying-options", &[]);
    let be32 = |v: u32| v.to_be_bytes().to_vec();
    let cat = |parts: &[Vec<u8>]| parts.concat();
    let name = b"disk".to_vec();
    let cases: Vec<(&str, u32, Vec<u8>)> = vec![
        ("GO: name longer than the option", OPT_GO, cat(&[be32(400), name.clone(), vec![0, 0]])),
        ("GO: name length past 4 GiB", OPT_GO, cat(&[be32(u32::MAX), name.clone(), vec![0, 0]])),
        ("GO: more information requests than sent", OPT_GO, cat(&[be32(4), name.clone(), vec![0, 9, 0, 1]])),
        ("GO: fewer information requests than sent", OPT_GO, cat(&[be32(4), name.clone(), vec![0, 0, 0, 1, 0, 3]])),
        ("GO: too short for a name length", OPT_GO, vec![0, 0]),
        ("INFO: name length short by one", OPT_INFO, cat(&[be32(3), name.clone(), vec![0, 0]])),
        (
            "LIST_META_CONTEXT: more queries than sent",
            OPT_LIST_META_CONTEXT,
            cat(&[be32(4), name.clone(), be32(3), be32(15), BASE_ALLOCATION.as_bytes().to_vec()]),
        ),
        (
            "LIST_META_CONTEXT: query longer than the option",
            OPT_LIST_META_CONTEXT,
            cat(&[be32(4), name.clone(), be32(1), be32(1000), BASE_ALLOCATION.as_bytes().to_vec()]),
        ),
        ("LIST_META_CONTEXT: name length past the end", OPT_LIST_META_CONTEXT, cat(&[be32(99), name.clone()])),
    ];
    let mut c = Client::handshake(fx.sock());
    c.structured_reply();
    for (what, opt, data) in &cases {
        let replies = c.option(*opt, data);
        let last = replies.last().unwrap();
        assert_eq!(last.typ, REP_ERR_INVALID, "{what}: want NBD_REP_ERR_INVALID, got {replies:?}");
    }
    // Still negotiating on the same connection, and still in sync.
    c.go("disk", &[]).expect("GO after the lies");
    c.assert_alive();
    c.disconnect();

    // An option that claims more data than the server will ever buffer
    // (4 GiB, 1 MiB) closes that connection at once, without waiting for it.
    for len in [u32::MAX, 1 << 20] {
        let mut c = Client::handshake(fx.sock());
        let mut msg = IHAVEOPT.to_be_bytes().to_vec();
        msg.extend_from_slice(&OPT_GO.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(&[0; 64]);
        c.send(&msg);
        c.expect_closed(&format!("an option claiming {len} bytes"));
    }
    let (mut c, _) = Client::open(fx.sock(), "disk");
    c.assert_alive();
    c.disconnect();
    fx.stop();
}

#[test]
fn requests_of_every_size_up_to_the_maximum() {
    // Every power of two from 1 byte to 32 MiB, and one less and one more,
    // written at an unaligned offset and read back with simple and with
    // structured replies (one byte more is refused: protocol.rs).
    let fx = Fixture::with_images("every-size", &[("disk", "40M")], &[]);
    let (mut simple, _) = Client::open(fx.sock(), "disk");
    let (mut structured, _, _) = Client::open_structured(fx.sock(), "disk");
    let mut sizes: Vec<u32> = (0..=25).flat_map(|k| [(1u32 << k) - 1, 1 << k, (1 << k) + 1]).collect();
    sizes.retain(|&n| n > 0 && n <= MAX_PAYLOAD);
    sizes.dedup();
    let offset = MIB + 4097;
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(1000 + i as u64, n as usize);
        simple.write(offset, &data, if i % 3 == 0 { CMD_FLAG_FUA } else { 0 });
        assert!(simple.read(offset, n) == data, "{n}-byte simple READ differs");
        assert!(structured.read(offset, n) == data, "{n}-byte structured READ differs");
    }
    eprintln!("{} request sizes, 1 byte to {} MiB", sizes.len(), MAX_PAYLOAD as u64 / MIB);
    simple.disconnect();
    structured.disconnect();
    fx.stop();
}

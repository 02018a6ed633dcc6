//! TLS on NBD and the export policy, with the clients people use: qemu-img and
//! qemu-io (tls-creds-x509 and tls-creds-psk objects, GnuTLS) and libnbd
//! (nbdinfo, nbdsh, nbdcopy with nbds+unix:// URIs). Certificates are made fresh
//! for each test with rcgen in qemu's directory layout (ca-cert.pem,
//! server-cert.pem, client-cert.pem...); pre-shared keys in its keys.psk.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};

use common::nbd::{
    Client, OPT_EXPORT_NAME, OPT_GO, OPT_INFO, OPT_LIST, OPT_STRUCTURED_REPLY, REP_ERR_POLICY, REP_ERR_TLS_REQD,
};
use common::*;
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A CA and the server and client certificates it signed, written as qemu and libnbd expect them.
struct Pki {
    /// ca-cert.pem, server-cert.pem, server-key.pem: what `vdisk serve --tls-certificates` takes.
    server: PathBuf,
    /// ca-cert.pem, client-cert.pem, client-key.pem: what qemu's endpoint=client and libnbd take.
    client: PathBuf,
    issuer: Issuer<'static, KeyPair>,
}

fn params(cn: &str, sans: &[&str]) -> CertificateParams {
    let mut p = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.not_before = date_time_ymd(2020, 1, 1);
    p.not_after = date_time_ymd(2040, 1, 1);
    p
}

fn write(path: PathBuf, text: &str) {
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

impl Pki {
    fn new(dir: &TempDir, tag: &str) -> Pki {
        let mut ca = params(&format!("vdisk test CA {tag}"), &[]);
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().unwrap();
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |cn: &str, purpose| {
            let mut p = params(cn, &["localhost", "127.0.0.1"]);
            p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
            p.extended_key_usages = vec![purpose];
            let key = KeyPair::generate().unwrap();
            (p.signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
        };
        let server = dir.path(&format!("{tag}-server"));
        let client = dir.path(&format!("{tag}-client"));
        for d in [&server, &client] {
            std::fs::create_dir_all(d).unwrap();
            write(d.join("ca-cert.pem"), &ca_pem);
        }
        let (cert, key) = leaf("vdisk test server", ExtendedKeyUsagePurpose::ServerAuth);
        write(server.join("server-cert.pem"), &cert);
        write(server.join("server-key.pem"), &key);
        let (cert, key) = leaf("vdisk test client", ExtendedKeyUsagePurpose::ClientAuth);
        write(client.join("client-cert.pem"), &cert);
        write(client.join("client-key.pem"), &key);
        Pki { server, client, issuer }
    }

    /// One more client directory (`tag`), its certificate with common name `cn` and DNS names `sans`.
    fn client(&self, dir: &TempDir, tag: &str, cn: &str, sans: &[&str]) -> PathBuf {
        let mut p = params(cn, sans);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let d = dir.path(tag);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(self.client.join("ca-cert.pem"), d.join("ca-cert.pem")).unwrap();
        write(d.join("client-cert.pem"), &p.signed_by(&key, &self.issuer).unwrap().pem());
        write(d.join("client-key.pem"), &key.serialize_pem());
        d
    }
}

/// qemu's --image-opts for an NBD export over the unix socket, with TLS object `tls0` when `tls`.
fn qemu_opts(server: &Server, export: &str, tls: bool) -> String {
    let mut o = format!("driver=nbd,server.type=unix,server.path={},export={export}", server.socket.display());
    if tls {
        o.push_str(",tls-creds=tls0,tls-hostname=localhost");
    }
    o
}

fn tls_object(client_dir: &Path) -> String {
    format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", client_dir.display())
}

/// qemu-io over TLS: runs `cmds`, returns the output (whatever the status).
fn qemu_io_tls(server: &Server, export: &str, client_dir: &Path, cmds: &[&str]) -> std::process::Output {
    let obj = tls_object(client_dir);
    let opts = qemu_opts(server, export, true);
    let mut args = vec!["--object", &obj, "--image-opts", &opts];
    for c in cmds {
        args.extend_from_slice(&["-c", c]);
    }
    output("qemu-io", &args)
}

fn assert_io_ok(out: &std::process::Output, what: &str) {
    let all = text(out);
    assert!(out.status.success() && !all.to_lowercase().contains("failed"), "{what}:\n{all}");
}

fn nbds_uri(server: &Server, export: &str, client_dir: &Path) -> String {
    format!("nbds+unix:///{export}?socket={}&tls-certificates={}", server.socket.display(), client_dir.display())
}

/// nbdsh connected to a URI that names local files (libnbd wants that allowed first); returns stdout.
fn nbdsh_tls(uri: &str, script: &str) -> String {
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let full = format!("h.set_uri_allow_local_file(True)\nh.connect_uri({uri:?})\n{script}");
    let out = std::process::Command::new("nbdsh")
        .env("PATH", path)
        .args(["-c", &full])
        .output()
        .unwrap_or_else(|e| panic!("cannot run nbdsh: {e} (is libnbd-bin installed?)"));
    assert!(out.status.success(), "nbdsh {uri}:\n{}\nscript:\n{full}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn nbdinfo(args: &[&str]) -> std::process::Output {
    output("nbdinfo", args)
}

/// What real clients never send, through the tests' raw NBD client: options a
/// plain client tries against `--tls=require`. Sends an option and returns the
/// kind of its (single) reply and the reply's data.
fn option(c: &mut Client, opt: u32, data: &[u8]) -> (u32, Vec<u8>) {
    c.send_option(opt, data);
    let reply = c.recv_option_reply(opt);
    (reply.typ, reply.data)
}

/// Everything the server still sends until it closes the connection.
fn rest(c: &mut Client) -> Vec<u8> {
    let mut all = Vec::new();
    let _ = c.sock.read_to_end(&mut all);
    all
}

fn go_data(export: &str) -> Vec<u8> {
    let mut d = (export.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

/// A new test directory with the PKI `a` and a sparse `disk.img` of `size`
/// in it: (dir, pki, image).
fn pki_and_disk(tag: &str, size: &str) -> (TempDir, Pki, PathBuf) {
    let dir = TempDir::new(tag);
    let pki = Pki::new(&dir, "a");
    let img = dir.path("disk.img");
    create_image(&img, size);
    (dir, pki, img)
}

#[test]
fn require_serves_tls_clients_and_gives_plain_ones_nothing() {
    let (dir, pki, img) = pki_and_disk("tls-require", "16M");
    let server = Server::start(&dir, &[s(&img), "--tls=require", "--tls-certificates", s(&pki.server)]);
    assert!(server.stdout.iter().any(|l| l.contains("TLS required")), "banner: {:#?}", server.stdout);

    // qemu-io (GnuTLS) writes and reads back through TLS.
    let out = qemu_io_tls(
        &server,
        "disk",
        &pki.client,
        &["write -P 0x5a 0 1M", "write -P 0x33 8M 64k", "read -P 0x5a 0 1M", "read -P 0x33 8M 64k", "flush"],
    );
    assert_io_ok(&out, "qemu-io over TLS");
    // qemu-img info over TLS.
    let obj = tls_object(&pki.client);
    let out = output(
        "qemu-img",
        &["info", "--object", &obj, "--image-opts", &qemu_opts(&server, "disk", true), "--output=json"],
    );
    assert!(out.status.success(), "qemu-img info over TLS:\n{}", text(&out));
    assert_eq!(json(&String::from_utf8_lossy(&out.stdout))["virtual-size"], 16 * MIB as u64);

    // libnbd: nbdinfo and nbdsh with nbds+unix://.
    let uri = nbds_uri(&server, "disk", &pki.client);
    let out = nbdinfo(&["--json", &uri]);
    assert!(out.status.success(), "nbdinfo {uri}:\n{}", text(&out));
    let info = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(info["exports"][0]["export-size"], 16 * MIB as u64, "{info}");
    let got = nbdsh_tls(&uri, "print(h.pread(4096, 8 << 20)[:4].hex())\nh.pwrite(b'\\x77' * 4096, 4 << 20)\nh.flush()");
    assert_eq!(got.trim(), "33333333");
    let out = nbdinfo(&["--list", &uri]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("disk"), "{}", text(&out));

    // Plain qemu-img and plain libnbd are refused.
    let out = output("qemu-img", &["info", &server.uri("disk")]);
    assert!(!out.status.success(), "plain qemu-img info succeeded against --tls=require:\n{}", text(&out));
    let out = output("qemu-io", &["-f", "raw", &server.uri("disk"), "-c", "read -v 0 512"]);
    assert!(!out.status.success(), "plain qemu-io read against --tls=require:\n{}", text(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("5a 5a"), "plain qemu-io got data:\n{}", text(&out));
    for args in [vec![server.uri("disk")], vec!["--list".to_owned(), server.uri("")]] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = nbdinfo(&args);
        assert!(!out.status.success(), "plain nbdinfo {args:?} succeeded:\n{}", text(&out));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("disk"), "plain nbdinfo learnt the export name");
    }

    // On the wire: every option but STARTTLS/ABORT gets ERR_TLS_REQD; EXPORT_NAME hangs up.
    let mut raw = Client::handshake(&server.socket);
    for opt in [OPT_LIST, OPT_STRUCTURED_REPLY, OPT_INFO, OPT_GO, 99] {
        let data = if opt == OPT_INFO || opt == OPT_GO { go_data("disk") } else { Vec::new() };
        let (kind, text) = option(&mut raw, opt, &data);
        assert_eq!(kind, REP_ERR_TLS_REQD, "option {opt}: {}", String::from_utf8_lossy(&text));
    }
    raw.send_option(OPT_EXPORT_NAME, b"disk");
    let rest = rest(&mut raw);
    assert!(rest.is_empty(), "NBD_OPT_EXPORT_NAME without TLS got {} bytes back", rest.len());
    // Nothing a plain client did reached the disk: the data is what TLS clients wrote.
    let out = qemu_io_tls(&server, "disk", &pki.client, &["read -P 0x77 4M 4k", "read -P 0x5a 0 1M"]);
    assert_io_ok(&out, "reading back over TLS");
    server.stop();
}

#[test]
fn on_serves_plain_and_tls_clients() {
    let (dir, pki, img) = pki_and_disk("tls-on", "8M");
    let server = Server::start(&dir, &[s(&img), "--tls=on", "--tls-certificates", s(&pki.server)]);
    qemu_io(&server.uri("disk"), &["write -P 0x11 0 64k"]);
    assert_io_ok(&qemu_io_tls(&server, "disk", &pki.client, &["read -P 0x11 0 64k", "write -P 0x22 1M 4k"]), "TLS");
    qemu_io(&server.uri("disk"), &["read -P 0x22 1M 4k"]);
    let out = nbdinfo(&[&nbds_uri(&server, "disk", &pki.client)]);
    assert!(out.status.success(), "nbdinfo over TLS with --tls=on:\n{}", text(&out));
    let out = nbdinfo(&[&server.uri("disk")]);
    assert!(out.status.success(), "plain nbdinfo with --tls=on:\n{}", text(&out));
    server.stop();
}

#[test]
fn a_client_trusting_another_ca_is_refused() {
    let (dir, pki, img) = pki_and_disk("tls-wrong-ca", "8M");
    let other = Pki::new(&dir, "b");
    let listen = format!("127.0.0.1:{}", free_port());
    let server =
        Server::start(&dir, &[s(&img), "--tls=require", "--tls-certificates", s(&pki.server), "--listen", &listen]);
    let out = qemu_io_tls(&server, "disk", &other.client, &["read 0 4k"]);
    assert!(!out.status.success(), "qemu-io trusting another CA connected:\n{}", text(&out));
    // libnbd checks the server's certificate on TCP only (on unix sockets it
    // does not, by design: see nbd_set_tls_verify_peer(3)).
    let tcp = |certs: &Path| format!("nbds://localhost:{}/disk?tls-certificates={}", &listen[10..], certs.display());
    let out = nbdinfo(&[&tcp(&other.client)]);
    assert!(!out.status.success(), "nbdinfo trusting another CA connected:\n{}", text(&out));
    let out = nbdinfo(&[&tcp(&pki.client)]);
    assert!(out.status.success(), "nbdinfo over TCP with the right CA:\n{}", text(&out));
    // The server goes on serving the right clients.
    assert_io_ok(&qemu_io_tls(&server, "disk", &pki.client, &["read 0 4k"]), "good client after bad ones");
    server.stop();
}

/// A TLS 1.2 ClientHello (the suites and groups rustls serves with the test's
/// ECDSA certificate, or RSA), as a client that then gives up would send it.
fn tls12_client_hello() -> Vec<u8> {
    let ext: &[u8] = &[
        0x00, 0x0a, 0x00, 0x04, 0x00, 0x02, 0x00, 0x1d, // supported_groups: x25519
        0x00, 0x0b, 0x00, 0x02, 0x01, 0x00, // ec_point_formats: uncompressed
        0x00, 0x0d, 0x00, 0x08, 0x00, 0x06, 0x04, 0x03, 0x08, 0x04, 0x04, 0x01, // signature_algorithms
    ];
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[0x5a; 32]); // random
    body.push(0); // no session id
    body.extend_from_slice(&[0x00, 0x04, 0xc0, 0x2b, 0xc0, 0x2f]); // ECDHE-{ECDSA,RSA}-AES128-GCM-SHA256
    body.extend_from_slice(&[0x01, 0x00]); // compression: null
    body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
    body.extend_from_slice(ext);
    let mut hs = vec![0x01, 0];
    hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 0x03, 0x01];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

/// Issue 22: a client that leaves in the middle of the TLS handshake, with a
/// close_notify (GnuTLS's gnutls_bye after refusing the server's certificate)
/// or by closing its half of the socket, is let go at once (nbd-server: 24 ms),
/// not after the 30 s handshake timeout; the server goes on serving others.
#[test]
fn a_client_leaving_mid_handshake_is_let_go_at_once() {
    use std::io::Write;
    use std::time::{Duration, Instant};
    let (dir, pki, img) = pki_and_disk("tls-leave", "8M");
    let server = Server::start(&dir, &[s(&img), "--tls=require", "--tls-certificates", s(&pki.server)]);
    for (how, goodbye) in [("close_notify", Some(&[0x15u8, 3, 3, 0, 2, 1, 0][..])), ("shutdown(write)", None)] {
        let mut raw = Client::handshake(&server.socket);
        let (kind, _) = option(&mut raw, vdisk_nbd::proto::OPT_STARTTLS, &[]);
        assert_eq!(kind, vdisk_nbd::proto::REP_ACK, "STARTTLS");
        raw.send(&tls12_client_hello());
        // The server's first flight shows the handshake is under way.
        let mut head = [0u8; 5];
        raw.sock.read_exact(&mut head).expect("the server's ServerHello");
        assert_eq!(head[0], 0x16, "the server answered the ClientHello with {head:?}, not a handshake record");
        let start = Instant::now();
        match goodbye {
            Some(alert) => raw.sock.write_all(alert).unwrap(),
            None => raw.sock.shutdown(std::net::Shutdown::Write).unwrap(),
        }
        raw.sock.set_read_timeout(Some(Duration::from_secs(40))).unwrap();
        let _ = rest(&mut raw);
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "after the client's {how} mid-handshake the server held on for {took:?}"
        );
    }
    // Others are served.
    assert_io_ok(&qemu_io_tls(&server, "disk", &pki.client, &["read 0 4k"]), "a good client after those that left");
    server.stop();
}

#[test]
fn verify_peer_wants_a_client_certificate_from_the_ca() {
    let (dir, pki, img) = pki_and_disk("tls-verify-peer", "8M");
    let other = Pki::new(&dir, "b");
    let server =
        Server::start(&dir, &[s(&img), "--tls=require", "--tls-certificates", s(&pki.server), "--tls-verify-peer"]);
    assert_io_ok(&qemu_io_tls(&server, "disk", &pki.client, &["read 0 4k"]), "client with its certificate");
    let out = nbdinfo(&[&nbds_uri(&server, "disk", &pki.client)]);
    assert!(out.status.success(), "nbdinfo with a client certificate:\n{}", text(&out));
    // No client certificate: only the CA.
    let bare = dir.path("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(pki.client.join("ca-cert.pem"), bare.join("ca-cert.pem")).unwrap();
    let out = qemu_io_tls(&server, "disk", &bare, &["read 0 4k"]);
    assert!(!out.status.success(), "qemu-io without a client certificate connected:\n{}", text(&out));
    // A client certificate from another CA, trusting the right server CA.
    let mixed = dir.path("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    std::fs::copy(pki.client.join("ca-cert.pem"), mixed.join("ca-cert.pem")).unwrap();
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(other.client.join(f), mixed.join(f)).unwrap();
    }
    let out = nbdinfo(&[&nbds_uri(&server, "disk", &mixed)]);
    assert!(!out.status.success(), "nbdinfo with a foreign client certificate connected:\n{}", text(&out));
    server.stop();
}

/// The export names `nbdinfo --list` shows at `uri` (empty when it fails).
fn listed(uri: &str) -> Vec<String> {
    let out = nbdinfo(&["--list", "--json", uri]);
    if !out.status.success() {
        return Vec::new();
    }
    let info = json(&String::from_utf8_lossy(&out.stdout));
    let mut names: Vec<String> =
        info["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap().to_owned()).collect();
    names.sort();
    names
}

/// nbdinfo's stderr for `uri` with export name `name` replaced, and whether it succeeded.
fn opened(uri: &str, name: &str) -> (bool, String) {
    let out = nbdinfo(&[uri]);
    (out.status.success(), String::from_utf8_lossy(&out.stderr).replace(name, "NAME"))
}

#[test]
fn allow_lists_admit_the_certificates_they_name_and_hide_from_others() {
    let (dir, pki, img) = pki_and_disk("tls-allow", "8M");
    let dns = dir.path("dns.img");
    let open = dir.path("open.img");
    create_image(&dns, "4M");
    create_image(&open, "4M");
    let vm = pki.client(&dir, "vm", "vm-7", &["vm7.internal"]);
    let db = pki.client(&dir, "db", "db-1", &["db1.Example.org"]);
    let server = Server::start(
        &dir,
        &[
            s(&img),
            s(&dns),
            s(&open),
            "--tls-certificates",
            s(&pki.server),
            "--tls-verify-peer",
            "--export-allow",
            "disk=CN=vm-*",
            "--export-allow",
            "dns=*.example.org",
            "--export-allow",
            "dns=CN=vm-7",
        ],
    );
    // On the list: it opens, with qemu-io and libnbd, and sees it listed.
    assert_io_ok(&qemu_io_tls(&server, "disk", &vm, &["write -P 0x5a 0 64k", "read -P 0x5a 0 64k"]), "vm-7 on disk");
    assert_eq!(listed(&nbds_uri(&server, "", &vm)), ["disk", "dns", "open"]);
    assert_eq!(listed(&nbds_uri(&server, "", &db)), ["dns", "open"], "db-1 must not see disk");
    assert_eq!(listed(&nbds_uri(&server, "", &pki.client)), ["open"], "a client on no list sees the open export only");
    assert!(opened(&nbds_uri(&server, "dns", &db), "dns").0, "db1.example.org (a DNS SAN, any case) opens dns");
    // Not on the list: exactly what an unknown export gets, for libnbd (GO) and qemu (GO).
    let (ok, denied) = opened(&nbds_uri(&server, "disk", &db), "disk");
    let (_, unknown) = opened(&nbds_uri(&server, "nosuch", &db), "nosuch");
    assert!(
        !ok,
        "db-1 opened disk:
{denied}"
    );
    assert_eq!(denied, unknown, "a refused client must get the answer for an unknown export");
    let out = qemu_io_tls(&server, "disk", &db, &["read -v 0 512"]);
    assert!(
        !out.status.success() && !text(&out).contains("5a 5a"),
        "qemu-io as db-1 read disk:
{}",
        text(&out)
    );
    let out = qemu_io_tls(&server, "disk", &pki.client, &["read 0 512"]);
    assert!(
        !out.status.success(),
        "qemu-io as a client on no list opened disk:
{}",
        text(&out)
    );
    // The empty name selects the first export only for whom it admits.
    assert!(opened(&nbds_uri(&server, "", &vm), "").0);
    assert!(!opened(&nbds_uri(&server, "", &db), "").0, "the default export is disk: db-1 may not");
    server.stop();
}

/// One JSON-RPC request on the control socket at `path`; the answer.
fn control(path: &Path, line: &str) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let mut c = std::io::BufReader::new(s);
    writeln!(c.get_mut(), "{line}").unwrap();
    let mut answer = String::new();
    c.read_line(&mut answer).unwrap();
    json(&answer)
}

#[test]
fn export_add_takes_an_allow_list() {
    let (dir, pki, img) = pki_and_disk("tls-allow-ctl", "4M");
    let vm = pki.client(&dir, "vm", "vm-1", &[]);
    let db = pki.client(&dir, "db", "db-1", &[]);
    let ctl = dir.path("ctl.sock");
    let server =
        Server::start(&dir, &["--tls-certificates", s(&pki.server), "--tls-verify-peer", "--control", s(&ctl)]);
    let add = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"export_add","params":{{"image":"{}","name":"vm","allow":["CN=vm-*"]}}}}"#,
        img.display()
    );
    let v = control(&ctl, &add);
    assert_eq!(v["result"]["name"], "vm", "{v}");
    let v = control(&ctl, r#"{"jsonrpc":"2.0","id":2,"method":"export_list"}"#);
    assert_eq!(v["result"][0]["allow"], serde_json::json!(["CN=vm-*"]), "{v}");
    assert!(opened(&nbds_uri(&server, "vm", &vm), "vm").0, "vm-1 opens the export added with its pattern");
    assert!(!opened(&nbds_uri(&server, "vm", &db), "vm").0, "db-1 opened it");
    assert!(listed(&nbds_uri(&server, "", &db)).is_empty(), "db-1 sees it listed");
    for (params, code) in [
        (r#"{"image":"/x","allow":"CN=a"}"#, -32602),
        (r#"{"image":"/x","allow":[1]}"#, -32602),
        (r#"{"image":"/x","name":"y","allow":["CN="]}"#, -32004),
    ] {
        let v = control(&ctl, &format!(r#"{{"jsonrpc":"2.0","id":3,"method":"export_add","params":{params}}}"#));
        assert_eq!(v["error"]["code"], code, "{params} -> {v}");
    }
    server.stop();
    // Without TLS the list could never admit anyone: refused, with the reason.
    let plain = Server::start(&dir, &["--control", s(&ctl)]);
    let v = control(&ctl, &add);
    assert_eq!(v["error"]["code"], -32004, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--tls-verify-peer"), "{v}");
    plain.stop();
}

#[test]
fn allow_lists_need_clients_the_server_can_identify() {
    let (_dir, pki, img) = pki_and_disk("tls-allow-usage", "1M");
    refused_at_startup(
        &img,
        &[
            (vec!["--export-allow", "disk=CN=vm-*"], "allow list"),
            (vec!["--export-allow", "disk=CN=vm-*", "--tls-certificates", s(&pki.server)], "--tls-verify-peer"),
            (vec!["--export-allow", "nosuch=CN=vm-*"], "no export \"nosuch\""),
            (vec!["--export-allow", "disk"], "NAME=PATTERN"),
            (vec!["--export-allow", "disk=CN=,x"], "ATTR=GLOB"),
        ],
    );
}

/// `vdisk serve IMG ARGS...` exits 2 saying what each case wants.
fn refused_at_startup(img: &Path, cases: &[(Vec<&str>, &str)]) {
    for (extra, want) in cases {
        let mut args = vec!["serve", s(img)];
        args.extend(extra.iter());
        let out = vdisk_bounded(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "vdisk {args:?}:\n{}", text(&out));
        assert!(err.contains(want), "vdisk {args:?} should say {want:?}:\n{err}");
    }
}

#[test]
fn bad_tls_settings_are_refused_at_startup() {
    let dir = TempDir::new("tls-bad");
    let img = dir.path("disk.img");
    create_image(&img, "1M");
    let empty = dir.path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tls=on"], "needs a certificate"),
        (vec!["--tls-certificates", s(&empty)], "server-cert.pem is missing"),
        (vec!["--tls=off", "--tls-certificates", s(&empty)], "--tls=off"),
    ];
    refused_at_startup(&img, &cases);
    // Garbage in the key file names the file.
    let pki = Pki::new(&dir, "a");
    std::fs::write(pki.server.join("server-key.pem"), "not a key\n").unwrap();
    let out = vdisk_bounded(&["serve", s(&img), "--tls=on", "--tls-certificates", s(&pki.server)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server-key.pem"), "{}", text(&out));
}

#[test]
fn exports_can_be_hidden_renamed_and_must_be_named() {
    let dir = TempDir::new("exports");
    let (a, b) = (dir.path("a.img"), dir.path("b.img"));
    create_image(&a, "1M");
    create_image(&b, "2M");
    let server = Server::start(
        &dir,
        &[s(&a), s(&b), "--export-name", "x7Kq2", "--no-list", "--no-default-export", "--readonly"],
    );
    // The renamed export is reachable by its name; the file stem and "" are not.
    let out = nbdinfo(&["--json", &server.uri("x7Kq2")]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(json(&String::from_utf8_lossy(&out.stdout))["exports"][0]["export-size"], MIB as u64);
    assert!(nbdinfo(&[&server.uri("b")]).status.success());
    for name in ["a", ""] {
        let out = nbdinfo(&[&server.uri(name)]);
        assert!(!out.status.success(), "export {name:?} opened:\n{}", text(&out));
    }
    let out = output("qemu-img", &["info", &server.uri("")]);
    assert!(!out.status.success(), "qemu-img opened the default export:\n{}", text(&out));
    // Listing is refused, and says so on the wire.
    let out = nbdinfo(&["--list", &server.uri("")]);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(!listed.contains("x7Kq2"), "--no-list still listed:\n{}", text(&out));
    let mut raw = Client::handshake(&server.socket);
    assert_eq!(option(&mut raw, OPT_LIST, &[]).0, REP_ERR_POLICY);
    server.stop();

    // More names than images is a usage error.
    let out = vdisk_bounded(&["serve", s(&a), "--export-name", "p", "--export-name", "q"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// `len` pseudo-random bytes from `seed`, with 64 KiB zero runs, so reads
/// come back as holes and data.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    let mut x = seed;
    for (i, chunk) in data.chunks_mut(8).enumerate() {
        xorshift(&mut x);
        if (i / 8192) % 3 != 0 {
            chunk.copy_from_slice(&x.to_le_bytes());
        }
    }
    data
}

/// Many connections, many requests in flight, large and small, over TLS:
/// nbdcopy (4 connections) writes a file in and reads it back unchanged.
#[test]
fn nbdcopy_over_tls_round_trips_the_data() {
    let (dir, pki, img) = pki_and_disk("tls-nbdcopy", "48M");
    let server = Server::start(&dir, &[s(&img), "--tls-certificates", s(&pki.server)]);
    let src = dir.path("src.bin");
    let data = pattern(48 * MIB, 0x9e37_79b9_7f4a_7c15);
    std::fs::write(&src, &data).unwrap();
    let uri = nbds_uri(&server, "disk", &pki.client);
    run("nbdcopy", &["--connections=4", s(&src), &uri]);
    let back = dir.path("back.bin");
    run("nbdcopy", &["--connections=4", &uri, s(&back)]);
    assert_same("nbdcopy over TLS", &read_file(&back), &data);
    server.stop();
    assert_same("the image", &read_file(&img), &data);
}

/// Pre-shared keys (built with `--features psk`, as scripts/test does).
#[cfg(feature = "psk")]
mod psk {
    use super::*;

    /// A psktool-style keys.psk in its own directory (qemu's tls-creds-psk dir=), mode 600.
    fn psk_dir(dir: &TempDir, tag: &str, lines: &[(&str, &str)]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let d = dir.path(tag);
        std::fs::create_dir_all(&d).unwrap();
        let text: String = lines.iter().map(|(user, key)| format!("{user}:{key}\n")).collect();
        let file = d.join("keys.psk");
        write(file.clone(), &text);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        d
    }

    /// 32 random bytes in hex, as psktool makes them.
    fn random_key() -> String {
        let mut b = [0u8; 32];
        std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut b).unwrap();
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// qemu-io with a tls-creds-psk object (`extra`: more of its properties, e.g. a GnuTLS priority).
    fn qemu_io_psk(server: &Server, keys: &Path, user: &str, extra: &str, cmds: &[&str]) -> std::process::Output {
        let obj = format!("tls-creds-psk,id=tls0,endpoint=client,dir={},username={user}{extra}", keys.display());
        let opts =
            format!("driver=nbd,server.type=unix,server.path={},export=disk,tls-creds=tls0", server.socket.display());
        let mut args = vec!["--object", &obj, "--image-opts", &opts];
        for c in cmds {
            args.extend_from_slice(&["-c", c]);
        }
        output("qemu-io", &args)
    }

    /// libnbd's PSK URI: the username is the URI's user part (libnbd 1.14 has no tls-username parameter).
    fn psk_uri(server: &Server, user: &str, keys: &Path) -> String {
        psk_uri_to(server, user, keys, "disk")
    }

    fn psk_uri_to(server: &Server, user: &str, keys: &Path, export: &str) -> String {
        format!(
            "nbds+unix://{user}@/{export}?socket={}&tls-psk-file={}",
            server.socket.display(),
            keys.join("keys.psk").display()
        )
    }

    /// GnuTLS limited to TLS 1.2 PSK suites (its default is TLS 1.3 external PSK).
    const TLS12_ONLY: &str = ",priority=NORMAL:-VERS-ALL:+VERS-TLS1.2:+ECDHE-PSK:+DHE-PSK:+PSK";

    /// A mirror with pivot to a vdisk that serves TLS-PSK only, as libnbd
    /// names it (`nbds+unix://USER@/NAME?socket=..&tls-psk-file=FILE`); a
    /// wrong key is refused before anything starts.
    #[test]
    fn mirror_to_a_vdisk_that_requires_tls_psk() {
        let dir = TempDir::new("mirror-tls-psk");
        let key = random_key();
        let keys = psk_dir(&dir, "server", &[("alice", &key)]);
        let far_img = dir.path("disk.img");
        create_image(&far_img, "16M");
        let far = Server::start(&dir, &[s(&far_img), "--tls=require", "--tls-psk", s(&keys.join("keys.psk"))]);
        let src = mirror_source("mirror-tls-psk-src", 43);
        let wrong = psk_dir(&dir, "wrong", &[("alice", &random_key())]);
        let out = common::control::ctl(&src.1, &["mirror", "disk", "--to", &psk_uri(&far, "alice", &wrong)]);
        assert!(!out.status.success() && text(&out).contains("TLS-PSK handshake failed"), "{}", text(&out));
        let client = psk_dir(&dir, "client", &[("alice", &key)]);
        let to = psk_uri(&far, "alice", &client);
        pivot_and_check(src, far, &to, &far_img);
    }

    #[test]
    fn psk_allow_lists_admit_the_users_they_name() {
        let dir = TempDir::new("tls-psk-allow");
        let (ka, kb) = (random_key(), random_key());
        let keys = psk_dir(&dir, "server", &[("alice", &ka), ("bob", &kb)]);
        let (img, other) = (dir.path("disk.img"), dir.path("other.img"));
        create_image(&img, "4M");
        create_image(&other, "4M");
        let file = keys.join("keys.psk");
        let server = Server::start(&dir, &[s(&img), s(&other), "--tls-psk", s(&file), "--export-allow", "disk=ali?e"]);
        let alice = psk_dir(&dir, "alice", &[("alice", &ka)]);
        let bob = psk_dir(&dir, "bob", &[("bob", &kb)]);
        let out = qemu_io_psk(&server, &alice, "alice", "", &["write -P 0x21 0 4k", "read -P 0x21 0 4k"]);
        assert_io_ok(&out, "alice on disk");
        let out = qemu_io_psk(&server, &bob, "bob", "", &["read -v 0 512"]);
        assert!(!out.status.success(), "qemu-io as bob opened disk:\n{}", text(&out));
        assert_eq!(listed(&psk_uri_to(&server, "alice", &alice, "")), ["disk", "other"]);
        assert_eq!(listed(&psk_uri_to(&server, "bob", &bob, "")), ["other"], "bob must not see disk");
        let (ok, denied) = opened(&psk_uri_to(&server, "bob", &bob, "disk"), "disk");
        let (_, unknown) = opened(&psk_uri_to(&server, "bob", &bob, "nosuch"), "nosuch");
        assert!(!ok && denied == unknown, "bob on disk must look like an unknown export:\n{denied}\n{unknown}");
        assert!(opened(&psk_uri_to(&server, "bob", &bob, "other"), "other").0, "bob opens the open export");
        assert!(opened(&psk_uri(&server, "alice", &alice), "disk").0);
        server.stop();
    }

    #[test]
    fn psk_serves_qemu_and_libnbd_and_refuses_wrong_keys() {
        let dir = TempDir::new("tls-psk");
        let key = random_key();
        let keys = psk_dir(&dir, "server", &[("carol", &random_key()), ("alice", &key)]);
        let img = dir.path("disk.img");
        create_image(&img, "16M");
        let file = keys.join("keys.psk");
        let server = Server::start(&dir, &[s(&img), "--tls=require", "--tls-psk", s(&file)]);
        assert!(server.stdout.iter().any(|l| l.contains("TLS required (PSK: 2 users")), "banner: {:#?}", server.stdout);

        // qemu-io (GnuTLS, TLS 1.3 external PSK) writes and reads back; then over TLS 1.2 PSK suites.
        let client = psk_dir(&dir, "client", &[("alice", &key)]);
        let out = qemu_io_psk(
            &server,
            &client,
            "alice",
            "",
            &["write -P 0x5a 0 1M", "write -P 0x33 8M 64k", "read -P 0x5a 0 1M", "read -P 0x33 8M 64k", "flush"],
        );
        assert_io_ok(&out, "qemu-io with tls-creds-psk");
        let out = qemu_io_psk(&server, &client, "alice", TLS12_ONLY, &["read -P 0x33 8M 64k", "write -P 0x44 2M 4k"]);
        assert_io_ok(&out, "qemu-io with tls-creds-psk over TLS 1.2");

        // libnbd: nbdinfo and nbdsh with tls-psk-file.
        let uri = psk_uri(&server, "alice", &client);
        let out = nbdinfo(&["--json", &uri]);
        assert!(out.status.success(), "nbdinfo {uri}:\n{}", text(&out));
        assert_eq!(json(&String::from_utf8_lossy(&out.stdout))["exports"][0]["export-size"], 16 * MIB as u64);
        let got =
            nbdsh_tls(&uri, "print(h.pread(4096, 2 << 20)[:4].hex())\nh.pwrite(b'\\x77' * 4096, 4 << 20)\nh.flush()");
        assert_eq!(got.trim(), "44444444");

        // A wrong key and an unknown user are refused, by both clients and both TLS versions.
        let wrong = psk_dir(&dir, "wrong", &[("alice", &random_key())]);
        let stranger = psk_dir(&dir, "stranger", &[("mallory", &key)]);
        for (keys, user) in [(&wrong, "alice"), (&stranger, "mallory")] {
            for prio in ["", TLS12_ONLY] {
                let out = qemu_io_psk(&server, keys, user, prio, &["read -v 0 512"]);
                assert!(
                    !out.status.success(),
                    "qemu-io as {user} from {} {prio} connected:\n{}",
                    keys.display(),
                    text(&out)
                );
                assert!(!String::from_utf8_lossy(&out.stdout).contains("5a 5a"), "{}", text(&out));
            }
            let out = nbdinfo(&[&psk_uri(&server, user, keys)]);
            assert!(!out.status.success(), "nbdinfo as {user} from {} connected:\n{}", keys.display(), text(&out));
        }

        // Plain clients get nothing with --tls=require.
        let out = output("qemu-io", &["-f", "raw", &server.uri("disk"), "-c", "read -v 0 512"]);
        assert!(!out.status.success(), "plain qemu-io read against --tls=require:\n{}", text(&out));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("5a 5a"), "plain qemu-io got data:\n{}", text(&out));
        let out = nbdinfo(&["--list", &server.uri("")]);
        assert!(!out.status.success(), "plain nbdinfo --list succeeded:\n{}", text(&out));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("disk"), "plain nbdinfo learnt the export name");

        // The server goes on serving the right client, and nothing else reached the disk.
        let out = qemu_io_psk(&server, &client, "alice", "", &["read -P 0x77 4M 4k", "read -P 0x5a 0 1M"]);
        assert_io_ok(&out, "reading back with the right key");
        server.stop();
    }

    /// qemu's tls-creds-psk directory as --tls-certificates, with --tls=on: PSK
    /// and plain clients both served; nbdcopy (4 connections, many requests in
    /// flight) round-trips data through OpenSSL.
    #[test]
    fn psk_from_a_qemu_creds_dir_with_nbdcopy() {
        let dir = TempDir::new("tls-psk-dir");
        let keys = psk_dir(&dir, "keys", &[("bob", &random_key())]);
        let img = dir.path("disk.img");
        create_image(&img, "24M");
        let server = Server::start(&dir, &[s(&img), "--tls=on", "--tls-certificates", s(&keys)]);
        assert!(server.stdout.iter().any(|l| l.contains("PSK: 1 user")), "banner: {:#?}", server.stdout);
        let data = pattern(24 * MIB, 0x2545_f491_4f6c_dd1d);
        let src = dir.path("src.bin");
        std::fs::write(&src, &data).unwrap();
        let uri = psk_uri(&server, "bob", &keys);
        run("nbdcopy", &["--connections=4", s(&src), &uri]);
        let back = dir.path("back.bin");
        run("nbdcopy", &["--connections=4", &uri, s(&back)]);
        assert_same("nbdcopy over TLS-PSK", &read_file(&back), &data);
        // A plain client is served too with --tls=on, and sees the same data.
        let out = output("qemu-io", &["-f", "raw", &server.uri("disk"), "-c", "read -v 0 8"]);
        let want: String = data[..8].iter().map(|b| format!("{b:02x} ")).collect();
        assert!(text(&out).contains(want.trim()), "plain read with --tls=on (want {want}):\n{}", text(&out));
        server.stop();
        assert_same("the image", &read_file(&img), &data);
    }

    #[test]
    fn bad_psk_settings_are_refused_at_startup() {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("tls-psk-bad");
        let img = dir.path("disk.img");
        create_image(&img, "1M");
        let keys = psk_dir(&dir, "keys", &[("alice", &random_key())]);
        let file = keys.join("keys.psk");
        let pki = Pki::new(&dir, "a");
        std::fs::copy(&file, pki.server.join("keys.psk")).unwrap();
        let garbage = psk_dir(&dir, "garbage", &[("alice", "12345")]).join("keys.psk");
        let missing = dir.path("nope.psk");
        let cases: Vec<(Vec<&str>, &str)> = vec![
            (vec!["--tls-psk", s(&file), "--tls-verify-peer"], "cannot be used with"),
            (vec!["--tls-certificates", s(&keys), "--tls-verify-peer"], "authenticate clients already"),
            (vec!["--tls-certificates", s(&pki.server)], "both keys.psk and server-cert.pem"),
            (vec!["--tls-psk", s(&garbage)], "line 1"),
            (vec!["--tls-psk", s(&missing)], "nope.psk"),
        ];
        refused_at_startup(&img, &cases);
        // Keys anyone may read are refused, naming the file and the fix.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let world_readable = format!("{} is readable by every user", file.display());
        refused_at_startup(
            &img,
            &[(vec!["--tls-psk", s(&file)], &world_readable), (vec!["--tls-psk", s(&file)], "chmod")],
        );
    }
}

/// A key and self-signed certificate for localhost made by `openssl req`,
/// with an RSA modulus of `bits`, in qemu's layout (the certificate is its own CA).
fn openssl_pki(dir: &TempDir, bits: u32) -> (PathBuf, PathBuf) {
    let server = dir.path(&format!("rsa{bits}-server"));
    let client = dir.path(&format!("rsa{bits}-client"));
    std::fs::create_dir_all(&server).unwrap();
    std::fs::create_dir_all(&client).unwrap();
    let out = output(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            &format!("rsa:{bits}"),
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            s(&server.join("server-key.pem")),
            "-out",
            s(&server.join("server-cert.pem")),
        ],
    );
    assert!(out.status.success(), "openssl req:\n{}", text(&out));
    std::fs::copy(server.join("server-cert.pem"), server.join("ca-cert.pem")).unwrap();
    std::fs::copy(server.join("server-cert.pem"), client.join("ca-cert.pem")).unwrap();
    (server, client)
}

/// A 2432-bit RSA key (primes of 1216 bits, not a multiple of 512), which
/// GnuTLS-based servers accept and rustls with ring refused, serves qemu;
/// a 1024-bit one is refused with a message that says why.
#[test]
fn rsa_keys_of_odd_sizes_are_served_and_small_ones_refused_with_the_reason() {
    let dir = TempDir::new("tls-rsa");
    let img = dir.path("disk.img");
    create_image(&img, "1M");
    let (server_dir, client_dir) = openssl_pki(&dir, 2432);
    let server = Server::start(&dir, &[s(&img), "--tls=on", "--tls-certificates", s(&server_dir)]);
    let out = qemu_io_tls(&server, "disk", &client_dir, &["write -P 0x24 0 64k", "read -P 0x24 0 64k"]);
    assert_io_ok(&out, "qemu-io over TLS with a 2432-bit RSA server key");
    server.stop();

    let (small, _) = openssl_pki(&dir, 1024);
    let out = vdisk_bounded(&["serve", s(&img), "--tls=on", "--tls-certificates", s(&small)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(err.contains("RSA with a 1024-bit modulus") && err.contains("2048 to 8192"), "unclear refusal: {err}");
}

/// A plain vdisk serving "disk" (16 MiB of data from `seed`) with a
/// control socket, the source of a mirror: its directory, control socket and server.
fn mirror_source(tag: &str, seed: u64) -> (TempDir, PathBuf, Server) {
    let dir = TempDir::new(tag);
    let disk = dir.path("disk.img");
    make_base(&disk, 16 * MIB, seed);
    let control = dir.path("ctl.sock");
    let server = Server::start(&dir, &[s(&disk), "--control", s(&control)]);
    (dir, control, server)
}

/// Mirrors `src`'s "disk" to `to` with `--pivot`, writes through the export
/// (now served from `far`), stops both servers and checks that `far_img`
/// holds what the export served.
fn pivot_and_check(src: (TempDir, PathBuf, Server), far: Server, to: &str, far_img: &Path) {
    let (src_dir, control, src) = src;
    let said = common::control::ctl_ok(&control, &["mirror", "disk", "--to", to, "--pivot", "--wait"]);
    assert!(said.contains("done"), "{said}");
    qemu_io(&src.uri("disk"), &["write -P 0x77 1M 64k", "read -P 0x77 1M 64k"]);
    let served = read_export(&src_dir, &src.uri("disk"), "served.raw");
    src.stop();
    far.stop();
    assert_same(&format!("the image behind {to}"), &read_file(far_img), &served);
}

/// A mirror to a second vdisk that serves TLS only: `vdisk ctl mirror
/// --to nbds+unix:///disk?socket=..&tls-certificates=DIR` connects with the
/// client directory of the CA that signed the server's certificate, and
/// with `--pivot` the export is served from the second vdisk over TLS from
/// then on. A plain URI, or a directory of another CA, is refused before
/// anything starts, saying why.
#[test]
fn mirror_to_a_vdisk_that_requires_tls() {
    let (dir, pki, far_img) = pki_and_disk("mirror-tls", "16M");
    let far = Server::start(&dir, &[s(&far_img), "--tls=require", "--tls-certificates", s(&pki.server)]);
    let src = mirror_source("mirror-tls-src", 41);
    let ctl_sock = src.1.clone();
    let refused = |to: &str, what: &str| {
        let out = common::control::ctl(&ctl_sock, &["mirror", "disk", "--to", to]);
        assert!(!out.status.success() && text(&out).contains(what), "mirror to {to}: {what:?} not in:\n{}", text(&out));
    };
    refused(&format!("nbd+unix:///disk?socket={}", far.socket.display()), "requires TLS");
    let other = Pki::new(&dir, "b");
    refused(&nbds_uri(&far, "disk", &other.client), "TLS handshake");
    refused(&format!("nbds+unix:///disk?socket={}", far.socket.display()), "tls-certificates=DIR");
    let jobs = json(&common::control::ctl_ok(&ctl_sock, &["jobs", "--json"]));
    assert_eq!(jobs.as_array().map(|j| j.len()), Some(0), "nothing started: {jobs}");
    let to = nbds_uri(&far, "disk", &pki.client);
    pivot_and_check(src, far, &to, &far_img);
}

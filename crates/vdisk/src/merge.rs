//! The command line's flags and the config file's `[server]` table put
//! together for `vdisk serve` (a flag wins over the same key; TLS settings
//! go as a unit), and the flags' enums as the daemon's. The file itself is
//! read by `vdisk_daemon::config`.

use vdisk_daemon::config::{bytes_of, mode_of, EngineChoice, ServerTable};
use vdisk_daemon::security::{TlsChoice, TlsSettings};
use vdisk_daemon::ImageFormat;

use crate::cli::{EngineArg, FormatArg, SecurityArgs, ServeArgs, TlsArg};

/// Fills in what the command line left out from `[server]` (the command line wins).
pub fn merge(a: &mut ServeArgs, s: &ServerTable) {
    fill(&mut a.socket, &s.socket);
    fill(&mut a.listen, &s.listen.as_ref().map(|l| l.get_ref().clone()));
    fill(&mut a.control, &s.control);
    fill(&mut a.metrics, &s.metrics.as_ref().map(|l| l.get_ref().clone()));
    if a.engine.is_none() {
        a.engine = s.engine.map(|e| match e {
            EngineChoice::Uring => EngineArg::Uring,
            EngineChoice::Threads => EngineArg::Threads,
        });
    }
    fill(&mut a.io_threads, &s.io_threads);
    if a.socket_mode.is_none() {
        a.socket_mode = s.socket_mode.as_ref().and_then(|m| mode_of(m.get_ref()).ok());
    }
    if a.control_mode.is_none() {
        a.control_mode = s.control_mode.as_ref().and_then(|m| mode_of(m.get_ref()).ok());
    }
    fill(&mut a.control_group, &s.control_group);
    if a.image_roots.is_empty() {
        a.image_roots = s.image_roots.clone().unwrap_or_default();
    }
    fill(&mut a.control_timeout, &s.control_timeout.as_ref().map(|t| *t.get_ref()));
    if a.max_connections.is_none() {
        a.max_connections = s.max_connections.as_ref().map(|n| *n.get_ref());
    }
    if a.stop_timeout.is_none() {
        a.stop_timeout = s.stop_timeout.as_ref().and_then(|t| t.get_ref().duration().ok());
    }
    if a.max_buffer_memory.is_none() {
        a.max_buffer_memory = s.max_buffer_memory.as_ref().and_then(|m| bytes_of(m.get_ref()).ok());
    }
    if a.send_timeout.is_none() {
        a.send_timeout = s.send_timeout.as_ref().map(|n| *n.get_ref());
    }
    let t = &a.security;
    let cli_tls = t.tls.is_some()
        || t.tls_certificates.is_some()
        || t.tls_cert.is_some()
        || t.tls_psk.is_some()
        || t.tls_ca.is_some()
        || t.tls_verify_peer;
    if !cli_tls {
        merge_tls(&mut a.security, s);
    }
}

fn merge_tls(t: &mut SecurityArgs, s: &ServerTable) {
    let f = s.tls_settings();
    t.tls = f.tls.map(|c| match c {
        TlsChoice::Off => TlsArg::Off,
        TlsChoice::On => TlsArg::On,
        TlsChoice::Require => TlsArg::Require,
    });
    t.tls_certificates = f.tls_certificates;
    t.tls_cert = f.tls_cert;
    t.tls_key = f.tls_key;
    t.tls_ca = f.tls_ca;
    t.tls_verify_peer = f.tls_verify_peer;
    t.tls_psk = f.tls_psk;
}

/// The TLS flags as the daemon's settings.
pub fn tls_settings(a: &SecurityArgs) -> TlsSettings {
    TlsSettings {
        tls: a.tls.map(|t| match t {
            TlsArg::Off => TlsChoice::Off,
            TlsArg::On => TlsChoice::On,
            TlsArg::Require => TlsChoice::Require,
        }),
        tls_certificates: a.tls_certificates.clone(),
        tls_cert: a.tls_cert.clone(),
        tls_key: a.tls_key.clone(),
        tls_ca: a.tls_ca.clone(),
        tls_verify_peer: a.tls_verify_peer,
        tls_psk: a.tls_psk.clone(),
        no_list: a.no_list,
        no_default_export: a.no_default_export,
    }
}

/// `--format` as the daemon's [`ImageFormat`].
pub fn image_format(f: FormatArg) -> ImageFormat {
    match f {
        FormatArg::Auto => ImageFormat::Auto,
        FormatArg::Raw => ImageFormat::Raw,
        FormatArg::Cow => ImageFormat::Cow,
        FormatArg::Qcow2 => ImageFormat::Qcow2,
    }
}

fn fill<T: Clone>(flag: &mut Option<T>, key: &Option<T>) {
    if flag.is_none() {
        flag.clone_from(key);
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use std::path::{Path, PathBuf};

    use vdisk_daemon::config::{load_text, Config};
    use vdisk_daemon::Error;

    use super::*;
    use crate::cli::{Cli, Command};

    fn serve_args(args: &[&str]) -> ServeArgs {
        let all = ["vdisk", "serve"].iter().chain(args).copied();
        match Cli::try_parse_from(all).unwrap().command {
            Command::Serve(a) => *a,
            _ => unreachable!(),
        }
    }

    /// `text` as a config file in /etc/vdisk.
    fn file(text: &str) -> (PathBuf, Result<Config, Error>) {
        let path = PathBuf::from("/etc/vdisk/vdisk.toml");
        let loaded = load_text(&path, text);
        (path, loaded)
    }

    #[test]
    fn the_command_line_wins_key_by_key() {
        let (_, c) = file("[server]\nsocket = \"/s\"\nlisten = \":1\"\nsocket_mode = 0o660\nengine = \"threads\"\n");
        let c = c.unwrap();
        let mut a = serve_args(&["--socket", "/mine", "--socket-mode", "0600"]);
        merge(&mut a, &c.server);
        assert_eq!(a.socket.as_deref(), Some(Path::new("/mine")));
        assert_eq!(a.socket_mode(), 0o600);
        assert_eq!(a.listen.as_deref(), Some(":1"), "not on the command line: the file's");
        assert_eq!(a.engine, Some(EngineArg::Threads));
    }

    #[test]
    fn stop_timeout_takes_units_or_seconds() {
        let (_, c) = file("[server]\nstop_timeout = \"5s\"\n");
        let mut a = serve_args(&[]);
        merge(&mut a, &c.unwrap().server);
        assert_eq!(a.stop_timeout, Some(std::time::Duration::from_secs(5)));
        let (_, c) = file("[server]\nstop_timeout = 7\n");
        let mut a = serve_args(&["--stop-timeout", "500ms"]);
        merge(&mut a, &c.unwrap().server);
        assert_eq!(a.stop_timeout, Some(std::time::Duration::from_millis(500)), "the command line wins");
        let (path, c) = file("[server]\nstop_timeout = \"soon\"\n");
        let e = c.unwrap_err().report().to_string();
        assert!(e.starts_with(&format!("{}:2: stop_timeout: \"soon\"", path.display())), "{e}");
    }

    #[test]
    fn control_keys_and_image_roots() {
        let text = "[server]\ncontrol_mode = \"0660\"\ncontrol_group = \"vdisk\"\nimage_roots = [\"vm\", \"/srv\"]\n\
                    control_timeout = 5\n";
        let (path, c) = file(text);
        let c = c.unwrap();
        let mut a = serve_args(&["--control-timeout", "9"]);
        merge(&mut a, &c.server);
        assert_eq!((a.control_mode, a.control_group.as_deref()), (Some(0o660), Some("vdisk")));
        assert_eq!(a.image_roots, [path.parent().unwrap().join("vm"), PathBuf::from("/srv")], "relative to the file");
        assert_eq!(a.control_timeout, Some(9), "the command line wins");
        let (_, c) = file("[server]\ncontrol_mode = \"0999\"\n");
        assert!(c.unwrap_err().report().to_string().contains(":2: control_mode"));
        let (_, c) = file("[server]\ncontrol_timeout = 0\n");
        assert!(c.unwrap_err().report().to_string().contains("control_timeout"));
    }

    /// One export, every key a reader takes, through the command line, the
    /// config file and `export_add`: the same [`vdisk_daemon::ExportSpec`].
    #[test]
    fn one_export_spec_from_flags_file_and_json_rpc() {
        let flags = "/srv/vm/disk.qcow2 --export-name vm1 --readonly --format qcow2 --backing /srv/vm/base.img \
                     --ignore-backing-mtime --ceph-conf /etc/ceph/other.conf --ceph-id vdisk --fuse /run/vm1.img \
                     --vhost-user-blk /run/vm1.sock --num-queues 4 --export-allow vm1=alice";
        let cli = serve_args(&flags.split_whitespace().collect::<Vec<_>>());
        let cli = crate::serve::export_specs(&cli, None).unwrap().remove(0);
        let toml = "[[export]]\nimage = \"/srv/vm/disk.qcow2\"\nname = \"vm1\"\nreadonly = true\nformat = \"qcow2\"\n\
                    backing = \"/srv/vm/base.img\"\nignore_backing_mtime = true\nceph_conf = \"/etc/ceph/other.conf\"\n\
                    ceph_id = \"vdisk\"\nfuse = \"/run/vm1.img\"\nvhost_user_blk = \"/run/vm1.sock\"\nnum_queues = 4\nallow = [\"alice\"]\n";
        let from_file = file(toml).1.unwrap().exports.remove(0);
        let line = br#"{"jsonrpc": "2.0", "id": 1, "method": "export_add", "params": {"image": "/srv/vm/disk.qcow2",
            "name": "vm1", "readonly": true, "format": "qcow2", "backing": "/srv/vm/base.img",
            "ignore_backing_mtime": true, "ceph_conf": "/etc/ceph/other.conf", "ceph_id": "vdisk",
            "fuse": "/run/vm1.img", "vhost_user_blk": "/run/vm1.sock", "num_queues": 4, "allow": ["alice"]}}"#;
        let rpc = vdisk_control::json::export_add_spec(line).unwrap();
        assert_eq!(cli, from_file, "command line and config file");
        assert_eq!(from_file, rpc, "config file and export_add");
        assert_eq!(
            (rpc.ceph_conf.as_deref(), &rpc.allow[..]),
            (Some(Path::new("/etc/ceph/other.conf")), &["alice".into()][..])
        );
        // QoS, which the command line has no flags for: the file and export_add agree.
        let from_file = file("[[export]]\nimage = \"/d.img\"\nname = \"d\"\niops = 5\nbps = \"1M\"\nwrite_bps = 7\n").1;
        let line = br#"{"jsonrpc": "2.0", "id": 1, "method": "export_add",
            "params": {"image": "/d.img", "name": "d", "iops": 5, "bps": 1048576, "write_bps": 7}}"#;
        assert_eq!(from_file.unwrap().exports.remove(0), vdisk_control::json::export_add_spec(line).unwrap());
    }
}

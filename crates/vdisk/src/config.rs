//! `vdisk serve --config FILE`: the TOML file of server settings (`[server]`)
//! and exports (one `[[export]]` table each), read into the same
//! [`ExportSpec`]s the command line and the control socket make. This module
//! parses and validates only; it starts nothing (the daemon does, and a
//! reload is [`crate::reload`]'s).
//!
//! Every mistake is one line: `FILE:LINE: what is wrong (and what to write)`.
//! Relative paths in the file are relative to the file's directory.
//!
//! How the file combines with the command line: a flag given on the command
//! line wins over the same `[server]` key (TLS settings go as a unit: any TLS
//! flag and the file's TLS keys are ignored); IMAGEs on the command line are
//! served beside the file's exports, and a reload leaves them alone.

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;
use vdisk_engine::Limits;

use crate::cli::{BackingArgs, EngineArg, FormatArg, SecurityArgs, ServeArgs, TlsArg};
use crate::daemon::{export_name, ExportSpec};
use crate::Failure;

/// A config file, read and checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub path: PathBuf,
    pub server: ServerTable,
    /// Each with its name set.
    pub exports: Vec<ExportSpec>,
    /// The line of each export's `[[export]]`, for messages.
    pub lines: Vec<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    server: Option<Spanned<ServerTable>>,
    #[serde(default)]
    export: Vec<Spanned<ExportTable>>,
}

/// `[server]`: each key is the `vdisk serve` flag of the same name.
#[derive(Deserialize, Default, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerTable {
    pub socket: Option<PathBuf>,
    pub listen: Option<Spanned<String>>,
    pub control: Option<PathBuf>,
    pub control_mode: Option<Spanned<Mode>>,
    pub control_group: Option<String>,
    /// Relative to the file's directory, like every path in it.
    pub image_roots: Option<Vec<PathBuf>>,
    pub control_timeout: Option<Spanned<u32>>,
    pub metrics: Option<Spanned<String>>,
    /// "0600" (a string, as on the command line) or 0o600 (a TOML octal number).
    pub socket_mode: Option<Spanned<Mode>>,
    pub max_connections: Option<Spanned<u32>>,
    /// "30s", "500ms", "2m", or a number of seconds.
    pub stop_timeout: Option<Spanned<Seconds>>,
    /// Bytes: a number, or a string with a K, M, G suffix ("512M").
    pub max_buffer_memory: Option<Spanned<Amount>>,
    pub send_timeout: Option<Spanned<u32>>,
    pub engine: Option<EngineArg>,
    pub io_threads: Option<u16>,
    pub tls: Option<TlsArg>,
    pub tls_certificates: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub tls_verify_peer: Option<bool>,
    pub tls_psk: Option<PathBuf>,
}

/// A duration: a number of seconds, or a string with a unit ("30s").
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum Seconds {
    Number(u64),
    Text(String),
}

impl Seconds {
    fn duration(&self) -> Result<std::time::Duration, String> {
        match self {
            Seconds::Number(n) => crate::stopping::parse_duration(&n.to_string()),
            Seconds::Text(s) => crate::stopping::parse_duration(s),
        }
    }
}

#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum Mode {
    Number(u32),
    Text(String),
}

/// `[[export]]`: the flags of `vdisk ctl add`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportTable {
    image: PathBuf,
    name: Option<String>,
    #[serde(default)]
    readonly: bool,
    format: Option<FormatArg>,
    backing: Option<PathBuf>,
    #[serde(default)]
    ignore_backing_mtime: bool,
    fuse: Option<PathBuf>,
    vhost_user_blk: Option<PathBuf>,
    num_queues: Option<u16>,
    iops: Option<u64>,
    bps: Option<Amount>,
    read_bps: Option<Amount>,
    write_bps: Option<Amount>,
    /// TLS identities that may open the export (README: Security).
    #[serde(default)]
    allow: Vec<String>,
}

/// Bytes (per second): a number, or a string with a K, M, G suffix ("100M").
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum Amount {
    Number(u64),
    Text(String),
}

/// Reads and checks `path`, and the TLS credentials it names; no image is opened.
pub fn load(path: &Path) -> Result<Config, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Failure::usage(format!("cannot read config file {}: {e} (give the path of a TOML file)", path.display()))
    })?;
    let line_of = |s: &Range<usize>| text[..s.start.min(text.len())].matches('\n').count() + 1;
    let at = |span: Option<Range<usize>>, what: &str| {
        let line = span.as_ref().map(line_of).unwrap_or(1);
        Failure::usage(format!("{}:{line}: {}", path.display(), what.trim().replace('\n', "; ")))
    };
    let file: File = toml::from_str(&text).map_err(|e| at(e.span(), e.message()))?;
    let dir = std::path::absolute(path).ok().and_then(|p| p.parent().map(Path::to_owned)).unwrap_or_default();
    let (mut server, server_span) = match file.server {
        Some(s) => (s.get_ref().clone(), s.span()),
        None => (ServerTable::default(), 0..0),
    };
    check_server(&server).map_err(|(span, what)| at(Some(span), &what))?;
    if let Some(roots) = &mut server.image_roots {
        roots.iter_mut().for_each(|r| *r = dir.join(&*r));
    }
    for p in [
        &mut server.socket,
        &mut server.control,
        &mut server.tls_certificates,
        &mut server.tls_cert,
        &mut server.tls_key,
        &mut server.tls_ca,
        &mut server.tls_psk,
    ] {
        *p = p.take().map(|p| dir.join(p));
    }
    check_tls(&server).map_err(|e| at(Some(server_span), &format!("[server] TLS settings: {e}")))?;
    let mut names = HashSet::new();
    let (mut exports, mut lines) = (Vec::new(), Vec::new());
    for table in file.export {
        let span = table.span();
        lines.push(line_of(&span));
        let spec = export_spec(table.into_inner(), &dir).map_err(|what| at(Some(span.clone()), &what))?;
        let name = spec.name.clone().unwrap_or_default();
        if !names.insert(name.clone()) {
            return Err(at(
                Some(span),
                &format!("a second export named {name:?}: give each [[export]] its own name = \"...\""),
            ));
        }
        exports.push(spec);
    }
    Ok(Config { path: path.to_owned(), server, exports, lines })
}

fn check_server(s: &ServerTable) -> Result<(), (Range<usize>, String)> {
    if let Some(mode) = &s.socket_mode {
        mode_of(mode.get_ref()).map_err(|e| (mode.span(), format!("socket_mode: {e}")))?;
    }
    if let Some(mode) = &s.control_mode {
        mode_of(mode.get_ref()).map_err(|e| (mode.span(), format!("control_mode: {e}")))?;
    }
    if let Some(t) = &s.control_timeout {
        if !(1..=86400).contains(t.get_ref()) {
            return Err((t.span(), "control_timeout: give 1 to 86400 seconds".into()));
        }
    }
    for (key, value, example) in [("listen", &s.listen, "127.0.0.1:10809"), ("metrics", &s.metrics, "127.0.0.1:9187")] {
        if let Some(v) = value {
            crate::serve::parse_listen(v.get_ref(), key, example).map_err(|e| (v.span(), e.to_string()))?;
        }
    }
    if let Some(t) = &s.stop_timeout {
        t.get_ref().duration().map_err(|e| (t.span(), format!("stop_timeout: {e}")))?;
    }
    if let Some(n) = &s.max_connections {
        if *n.get_ref() == 0 {
            return Err((n.span(), "max_connections must be at least 1 (leave it out for 1024)".into()));
        }
    }
    if let Some(n) = &s.send_timeout {
        if *n.get_ref() == 0 {
            return Err((n.span(), "send_timeout must be at least 1 second (leave it out for 60)".into()));
        }
    }
    if let Some(m) = &s.max_buffer_memory {
        bytes_of(m.get_ref())
            .map_err(|e| (m.span(), format!("max_buffer_memory: {e} (e.g. max_buffer_memory = \"2G\")")))?;
    }
    Ok(())
}

fn bytes_of(a: &Amount) -> Result<u64, String> {
    match a {
        Amount::Number(n) => Ok(*n),
        Amount::Text(s) => crate::size::parse_size(s).map_err(|e| format!("{s:?}: {e}")),
    }
}

/// The TLS keys load as the same flags would (credentials read and checked).
fn check_tls(s: &ServerTable) -> Result<(), Failure> {
    let mut a = SecurityArgs::default();
    merge_tls(&mut a, s);
    crate::security::policy(&a).map(drop)
}

fn mode_of(m: &Mode) -> Result<u32, String> {
    match m {
        Mode::Number(n) if *n <= 0o777 => Ok(*n),
        Mode::Number(n) => Err(format!("{n:#o} is not a permission mode: write \"0600\" or 0o600")),
        Mode::Text(s) => crate::cli::parse_mode(s),
    }
}

/// One `[[export]]` as the daemon takes it; paths made relative to `dir`.
fn export_spec(t: ExportTable, dir: &Path) -> Result<ExportSpec, String> {
    // Relative to the file; an rbd:POOL/IMAGE name is no path.
    let rel = |p: PathBuf| if p.is_relative() && !vdisk_image::rbd::is_rbd(&p) { dir.join(p) } else { p };
    let image = rel(t.image);
    let name = t.name.unwrap_or_else(|| export_name(&image));
    if name.is_empty() || name.len() > 4096 || name.chars().any(char::is_control) {
        return Err(format!("name {name:?}: give 1 to 4096 characters without control characters"));
    }
    if t.num_queues.is_some() && t.vhost_user_blk.is_none() {
        return Err(format!(
            "export {name:?}: num_queues applies to vhost_user_blk only: add vhost_user_blk = \"SOCKET\""
        ));
    }
    if let Some(n @ (0 | 65..)) = t.num_queues {
        return Err(format!("export {name:?}: num_queues {n} is not between 1 and 64"));
    }
    vdisk_nbd::allow::Allow::new(&t.allow).map_err(|e| format!("export {name:?}: {e}"))?;
    let amount = |key: &str, a: Option<Amount>| -> Result<u64, String> {
        match a {
            None => Ok(0),
            Some(Amount::Number(n)) => Ok(n),
            Some(Amount::Text(s)) => crate::size::parse_size(&s)
                .map_err(|e| format!("export {name:?}: {key} {s:?}: {e} (e.g. {key} = \"100M\")")),
        }
    };
    let limits = Limits {
        iops: t.iops.unwrap_or(0),
        bps: amount("bps", t.bps)?,
        read_bps: amount("read_bps", t.read_bps)?,
        write_bps: amount("write_bps", t.write_bps)?,
    };
    Ok(ExportSpec {
        image,
        name: Some(name),
        readonly: t.readonly,
        format: t.format.unwrap_or(FormatArg::Auto),
        backing: BackingArgs {
            backing: t.backing.map(rel),
            ignore_backing_mtime: t.ignore_backing_mtime,
            ceph: Default::default(),
        },
        fuse: t.fuse.map(rel),
        vhost_user_blk: t.vhost_user_blk.map(rel),
        num_queues: t.num_queues,
        limits,
        allow: t.allow,
    })
}

/// Fills in what the command line left out from `[server]` (the command line wins).
pub fn merge(a: &mut ServeArgs, s: &ServerTable) {
    fill(&mut a.socket, &s.socket);
    fill(&mut a.listen, &s.listen.as_ref().map(|l| l.get_ref().clone()));
    fill(&mut a.control, &s.control);
    fill(&mut a.metrics, &s.metrics.as_ref().map(|l| l.get_ref().clone()));
    fill(&mut a.engine, &s.engine);
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
    t.tls = s.tls;
    t.tls_certificates = s.tls_certificates.clone();
    t.tls_cert = s.tls_cert.clone();
    t.tls_key = s.tls_key.clone();
    t.tls_ca = s.tls_ca.clone();
    t.tls_verify_peer = s.tls_verify_peer.unwrap_or(false);
    t.tls_psk = s.tls_psk.clone();
}

fn fill<T: Clone>(flag: &mut Option<T>, key: &Option<T>) {
    if flag.is_none() {
        flag.clone_from(key);
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn serve_args(args: &[&str]) -> ServeArgs {
        let all = ["vdisk", "serve"].iter().chain(args).copied();
        match Cli::try_parse_from(all).unwrap().command {
            Command::Serve(a) => *a,
            _ => unreachable!(),
        }
    }

    fn file(text: &str) -> (std::path::PathBuf, Result<Config, Failure>) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vdisk-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let loaded = load(&path);
        let _ = std::fs::remove_file(&path);
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
        let e = c.unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:2: stop_timeout: \"soon\"", path.display())), "{e}");
    }

    #[test]
    fn exports_get_names_paths_and_limits() {
        let (path, c) = file("[[export]]\nimage = \"d/vm.img\"\nbps = \"10M\"\niops = 5\n");
        let c = c.unwrap();
        let e = &c.exports[0];
        assert_eq!(e.name.as_deref(), Some("vm"));
        assert_eq!(e.image, path.parent().unwrap().join("d/vm.img"), "relative to the file");
        assert_eq!((e.limits.iops, e.limits.bps), (5, 10 << 20));
        assert_eq!(c.lines, [1]);
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
        assert!(c.unwrap_err().to_string().contains(":2: control_mode"));
        let (_, c) = file("[server]\ncontrol_timeout = 0\n");
        assert!(c.unwrap_err().to_string().contains("control_timeout"));
    }

    #[test]
    fn mistakes_name_file_and_line() {
        let (path, c) = file("[server]\n\n[[export]]\nimage = \"a\"\nname = \"\"\n");
        let e = c.unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:3: name \"\"", path.display())), "{e}");
        let (_, c) = file("[[export]]\nimage = \"a\"\nbps = \"ten\"\n");
        assert!(c.unwrap_err().to_string().contains(":1: export \"a\": bps \"ten\""));
    }
}

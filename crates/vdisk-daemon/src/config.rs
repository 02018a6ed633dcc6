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

use crate::security::{TlsChoice, TlsSettings};
use crate::spec::{Amount, ExportSpec};
use crate::Error;

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
    export: Vec<Spanned<ExportSpec>>,
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
    pub engine: Option<EngineChoice>,
    pub io_threads: Option<u16>,
    pub tls: Option<TlsChoice>,
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
    pub fn duration(&self) -> Result<std::time::Duration, String> {
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

/// `engine = "uring"` or `"threads"`: as `--engine`.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    Uring,
    Threads,
}

/// Reads and checks `path`, and the TLS credentials it names; no image is opened.
pub fn load(path: &Path) -> Result<Config, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::invalid(format!("cannot read config file {}: {e} (give the path of a TOML file)", path.display()))
    })?;
    load_text(path, &text)
}

/// [`load`] of `text` as if read from `path` (relative paths in it are
/// relative to `path`'s directory; messages name `path`).
pub fn load_text(path: &Path, text: &str) -> Result<Config, Error> {
    let line_of = |s: &Range<usize>| text[..s.start.min(text.len())].matches('\n').count() + 1;
    let at = |span: Option<Range<usize>>, what: &str| {
        let line = span.as_ref().map(line_of).unwrap_or(1);
        Error::invalid(format!("{}:{line}: {}", path.display(), what.trim().replace('\n', "; ")))
    };
    let file: File = toml::from_str(text).map_err(|e| at(e.span(), e.message()))?;
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
    check_tls(&server).map_err(|e| at(Some(server_span), &format!("[server] TLS settings: {}", e.report())))?;
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
            crate::listen::parse_listen(v.get_ref(), key, example).map_err(|e| (v.span(), e.report().to_string()))?;
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

pub fn bytes_of(a: &Amount) -> Result<u64, String> {
    match a {
        Amount::Number(n) => Ok(*n),
        Amount::Text(s) => crate::size::parse_size(s).map_err(|e| format!("{s:?}: {e}")),
    }
}

/// The TLS keys load as the same flags would (credentials read and checked).
fn check_tls(s: &ServerTable) -> Result<(), Error> {
    crate::security::policy(&s.tls_settings()).map(drop)
}

impl ServerTable {
    /// Its TLS keys, as the TLS flags would give them.
    pub fn tls_settings(&self) -> TlsSettings {
        TlsSettings {
            tls: self.tls,
            tls_certificates: self.tls_certificates.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_verify_peer: self.tls_verify_peer.unwrap_or(false),
            tls_psk: self.tls_psk.clone(),
            ..Default::default()
        }
    }
}

/// An octal permission mode such as 0600 or 660.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal permission mode such as 0600 or 0660"))
}

pub fn mode_of(m: &Mode) -> Result<u32, String> {
    match m {
        Mode::Number(n) if *n <= 0o777 => Ok(*n),
        Mode::Number(n) => Err(format!("{n:#o} is not a permission mode: write \"0600\" or 0o600")),
        Mode::Text(s) => parse_mode(s),
    }
}

/// One `[[export]]` as the daemon takes it: checked, paths made relative to `dir`.
fn export_spec(mut spec: ExportSpec, dir: &Path) -> Result<ExportSpec, String> {
    spec.image = relative(dir, std::mem::take(&mut spec.image));
    for p in [&mut spec.backing, &mut spec.fuse, &mut spec.vhost_user_blk, &mut spec.ceph_conf] {
        *p = p.take().map(|p| relative(dir, p));
    }
    spec.check().map_err(|e| e.message().to_owned())?;
    Ok(spec)
}

/// A path of the file, relative to its directory; an rbd:POOL/IMAGE name is no path.
fn relative(dir: &Path, p: PathBuf) -> PathBuf {
    if p.is_relative() && !vdisk_image::rbd::is_rbd(&p) {
        dir.join(p)
    } else {
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> (std::path::PathBuf, Result<Config, Error>) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vdisk-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let loaded = load(&path);
        let _ = std::fs::remove_file(&path);
        (path, loaded)
    }

    #[test]
    fn exports_get_names_paths_and_limits() {
        let (path, c) = file("[[export]]\nimage = \"d/vm.img\"\nbps = \"10M\"\niops = 5\n");
        let c = c.unwrap();
        let e = &c.exports[0];
        assert_eq!(e.name.as_deref(), Some("vm"));
        assert_eq!(e.image, path.parent().unwrap().join("d/vm.img"), "relative to the file");
        assert_eq!((e.limits().iops, e.limits().bps), (5, 10 << 20));
        assert_eq!(c.lines, [1]);
    }

    #[test]
    fn mistakes_name_file_and_line() {
        let (path, c) = file("[server]\n\n[[export]]\nimage = \"a\"\nname = \"\"\n");
        let e = c.unwrap_err().report().to_string();
        assert!(e.starts_with(&format!("{}:3: \"\" cannot be an export name", path.display())), "{e}");
        let (_, c) = file("[[export]]\nimage = \"a\"\nbps = \"ten\"\n");
        assert!(c.unwrap_err().report().to_string().contains(":1: export \"a\": bps \"ten\""));
    }
}

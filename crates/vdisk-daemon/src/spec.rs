//! [`ExportSpec`]: one export to serve, as the command line (`vdisk serve`
//! IMAGE and its flags), the config file (`[[export]]`) and the control
//! socket (`export_add`) all give it. One serde struct, one set of keys (the
//! flags' names with `_`), one check ([`ExportSpec::check`]), so the three
//! cannot drift apart.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use vdisk_engine::Limits;

use crate::Error;

/// Which format to open an image as (`--format`, `format = "..."`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// qcow2 or a COW overlay by its magic, raw otherwise.
    #[default]
    Auto,
    Raw,
    Cow,
    Qcow2,
}

impl ImageFormat {
    /// The format this forces, or None to detect it.
    pub fn forced(self) -> Option<vdisk_image::Format> {
        match self {
            ImageFormat::Auto => None,
            ImageFormat::Raw => Some(vdisk_image::Format::Raw),
            ImageFormat::Cow => Some(vdisk_image::Format::Cow),
            ImageFormat::Qcow2 => Some(vdisk_image::Format::Qcow2),
        }
    }
}

/// Bytes (per second): a number, or a string with a K, M, G suffix ("100M"),
/// as a file may write it; [`ExportSpec::check`] turns text into a number.
#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(untagged)]
pub enum Amount {
    Number(u64),
    Text(String),
}

impl Default for Amount {
    fn default() -> Self {
        Amount::Number(0)
    }
}

impl Amount {
    /// The number, 0 for text not yet checked.
    fn value(&self) -> u64 {
        match self {
            Amount::Number(n) => *n,
            Amount::Text(_) => 0,
        }
    }
}

/// One export to add: the image and how to serve it.
#[derive(Clone, Debug, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSpec {
    /// A file, or `rbd:POOL/IMAGE[@SNAP]`.
    pub image: PathBuf,
    /// Default: the image's file stem (an RBD image's name).
    pub name: Option<String>,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub format: ImageFormat,
    /// A COW or qcow2 overlay's backing file, instead of its header's.
    pub backing: Option<PathBuf>,
    #[serde(default)]
    pub ignore_backing_mtime: bool,
    /// The Ceph configuration and client id for `rbd:` images.
    pub ceph_conf: Option<PathBuf>,
    pub ceph_id: Option<String>,
    /// Also serve it as a regular file here (FUSE).
    pub fuse: Option<PathBuf>,
    /// Also serve it to a VM on this vhost-user-blk socket.
    pub vhost_user_blk: Option<PathBuf>,
    /// Virtqueues of the vhost-user-blk export, 1 to 64.
    pub num_queues: Option<u64>,
    /// QoS limits; 0 is none.
    #[serde(default)]
    pub iops: u64,
    #[serde(default)]
    pub bps: Amount,
    #[serde(default)]
    pub read_bps: Amount,
    #[serde(default)]
    pub write_bps: Amount,
    /// TLS identities that may open it over NBD (vdisk_nbd::allow); empty: anyone.
    #[serde(default)]
    pub allow: Vec<String>,
}

impl ExportSpec {
    /// Its QoS limits.
    pub fn limits(&self) -> Limits {
        Limits {
            iops: self.iops,
            bps: self.bps.value(),
            read_bps: self.read_bps.value(),
            write_bps: self.write_bps.value(),
        }
    }

    pub fn set_limits(&mut self, l: Limits) {
        self.iops = l.iops;
        self.bps = Amount::Number(l.bps);
        self.read_bps = Amount::Number(l.read_bps);
        self.write_bps = Amount::Number(l.write_bps);
    }

    /// Its name, given or the image's default.
    pub fn export_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| export_name(&self.image))
    }

    /// The checks every reader makes (the command line, the config file and
    /// `export_add` all reach them through [`crate::Daemon::add`]): the name is
    /// set and fits NBD, the vhost options go together, allow patterns parse,
    /// amounts are numbers.
    pub fn check(&mut self) -> Result<(), Error> {
        let name = self.export_name();
        check_name(&name)?;
        let bad = |what: String| Error::invalid(format!("export {name:?}: {what}"));
        if let Some(n @ (0 | 65..)) = self.num_queues {
            return Err(bad(format!("num_queues {n} is not between 1 and 64")));
        }
        if self.num_queues.is_some() && self.vhost_user_blk.is_none() {
            return Err(bad("num_queues applies to vhost_user_blk only: add vhost_user_blk = \"SOCKET\"".into()));
        }
        vdisk_nbd::allow::Allow::new(&self.allow).map_err(|e| bad(e.to_string()))?;
        for (key, a) in [("bps", &mut self.bps), ("read_bps", &mut self.read_bps), ("write_bps", &mut self.write_bps)] {
            if let Amount::Text(s) = a {
                let n =
                    crate::size::parse_size(s).map_err(|e| bad(format!("{key} {s:?}: {e} (e.g. {key} = \"100M\")")))?;
                *a = Amount::Number(n);
            }
        }
        self.name = Some(name);
        Ok(())
    }

    /// The open options it asks for.
    pub fn open_options(&self, direct: bool) -> vdisk_image::OpenOptions {
        vdisk_image::OpenOptions {
            format: self.format.forced(),
            read_only: self.readonly,
            direct,
            backing: self.backing.clone(),
            ignore_backing_mtime: self.ignore_backing_mtime,
            ceph: self.ceph(),
            roots: None,
        }
    }

    /// How to reach its Ceph cluster, if it is an `rbd:` image.
    pub fn ceph(&self) -> vdisk_image::rbd::ConnectOptions {
        vdisk_image::rbd::ConnectOptions { conf: self.ceph_conf.clone(), id: self.ceph_id.clone(), extra: Vec::new() }
    }
}

/// NBD names are at most 4096 bytes; an empty one would shadow the default export.
pub(crate) fn check_name(name: &str) -> Result<(), Error> {
    if name.is_empty() || name.len() > 4096 || name.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{name:?} cannot be an export name: give 1 to 4096 bytes without control characters"
        )));
    }
    Ok(())
}

/// QoS limits as the log shows them.
pub fn limits_text(l: Limits) -> String {
    format!("{{\"bps\":{},\"iops\":{},\"read_bps\":{},\"write_bps\":{}}}", l.bps, l.iops, l.read_bps, l.write_bps)
}

/// The export name of an image: an RBD image's name (and snapshot), a file's stem.
pub fn export_name(path: &Path) -> String {
    crate::formats::export_name(path)
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "disk".into()))
}

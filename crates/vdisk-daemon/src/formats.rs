//! The daemon's side of opening an image: its one-line description for the
//! export list, and its errors. Which format a file is, what an `rbd:` name
//! means and which options fit which format are decided by
//! [`vdisk_image::open`], once, for every command. An NBD URI (another
//! server's export, served through [`vdisk_nbd::remote`]) is opened here:
//! vdisk-image knows no network.

use std::path::Path;
use std::sync::Arc;

use vdisk_image::rbd::{ConnectOptions, Spec};
use vdisk_image::{Format, Image, Target};
use vdisk_nbd::remote::{Address, Remote, RemoteDisk, Uri};

use crate::size::human;
use crate::Error;

/// An opened image and a one-line description of it for the export list.
pub struct Opened {
    pub image: Arc<dyn Image>,
    pub description: String,
}

/// The RBD image an `rbd:` name means, or None for a path.
pub fn rbd_spec(name: &Path, defaults: &ConnectOptions) -> Result<Option<Spec>, Error> {
    match Target::parse(name, defaults)? {
        Target::Rbd(spec) => Ok(Some(spec)),
        Target::File(_) => Ok(None),
    }
}

/// The NBD URI an image's name is, if it is one (another server's export).
pub fn nbd_uri(name: &Path) -> Option<&str> {
    name.to_str().filter(|s| Uri::is_nbd(s))
}

/// The export name an image gets by default: an RBD image's name (and
/// snapshot), an NBD URI's export name, a file's stem. None: the caller's own rule.
pub fn export_name(name: &Path) -> Option<String> {
    if let Some(uri) = nbd_uri(name) {
        return Uri::parse(uri).ok().map(|u| u.export).filter(|e| !e.is_empty());
    }
    Target::parse(name, &ConnectOptions::default()).ok()?.export_name()
}

/// Opens an image for serving (within the caller's image roots, if any).
pub fn open(image: &Path, options: &vdisk_image::OpenOptions) -> Result<Opened, Error> {
    if let Some(uri) = nbd_uri(image) {
        return open_nbd(uri, options);
    }
    let direct = options.direct;
    let opened = vdisk_image::open(image, options).map_err(|e| {
        // The file system cannot do what --direct asked: the user's choice, exit 2.
        if direct && e.kind() == vdisk_image::ErrorKind::Unsupported {
            Error::image(crate::error::ErrorKind::Invalid, &e)
        } else {
            Error::from(e)
        }
    })?;
    let description = describe(&opened);
    Ok(Opened { image: opened.image, description })
}

/// Serves another server's NBD export: all its bytes, one to one, read
/// and written with blocking calls (the engine gives them a thread of their
/// own, so a server that stalls holds up this export only).
fn open_nbd(uri: &str, options: &vdisk_image::OpenOptions) -> Result<Opened, Error> {
    if options.format.is_some_and(|f| f != Format::Raw) || options.backing.is_some() {
        return Err(Error::invalid(format!(
            "{uri}: an NBD export is served as the bytes it holds: format and backing options do not apply"
        )));
    }
    let (parsed, remote) = connect_nbd(uri).map_err(Error::invalid)?;
    let remote = remote.map_err(|e| Error::failed(format!("cannot open the NBD export {uri}: {e}")))?;
    let read_only = remote.flags & vdisk_nbd::proto::TF_READ_ONLY != 0;
    if read_only && !options.read_only {
        return Err(Error::invalid(format!(
            "the NBD export {uri} is read-only: serve it read-only (--readonly, or readonly = true)"
        )));
    }
    let size = remote.size;
    let disk = Box::new(RemoteDisk::new(parsed, remote));
    let image = Arc::new(vdisk_image::RemoteImage::new(uri, size, options.read_only, "nbd", disk));
    Ok(Opened { image, description: format!("{uri} (nbd, {})", human(size)) })
}

/// Connects to the NBD export `uri` names. Within image roots (the caller's
/// [`vdisk_image::files::confined`]), its unix socket and the TLS
/// credentials it names must lie beneath them. Err: the URI is refused; Ok(Err): the server
/// could not be reached or refused the export.
pub fn connect_nbd(uri: &str) -> Result<(Uri, std::io::Result<Remote>), String> {
    let u = Uri::parse(uri)?;
    let socket = match &u.address {
        Address::Unix(path) => Some(path),
        Address::Tcp { .. } => None,
    };
    let credentials = u.tls.iter().flat_map(|t| [&t.certificates, &t.psk_file]).flatten();
    for path in socket.into_iter().chain(credentials) {
        vdisk_image::files::check_confined(path).map_err(|e| format!("{uri}: {}", e.report()))?;
    }
    let remote = Remote::open(&u);
    Ok((u, remote))
}

/// "disk.qcow2 (qcow2 over /srv/base.img (raw), 10 GiB)": what the export
/// list shows of an image. Presentation: sizes in the command line's units.
pub fn describe(o: &vdisk_image::Opened) -> String {
    let size = human(o.image.size());
    let kind = match (&o.target, &o.backing) {
        (Target::Rbd(spec), _) if spec.snap.is_some() => "rbd, snapshot".to_owned(),
        (_, Some(b)) if o.format == Format::Qcow2 => format!("qcow2 over {} ({})", b.name.display(), b.format),
        (_, Some(b)) => format!("{} over {}", o.format, b.name.display()),
        (_, None) => o.format.to_string(),
    };
    format!("{} ({kind}, {size})", o.target)
}

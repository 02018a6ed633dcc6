//! Who may use the control socket. The socket file's own mode and group say
//! who may connect (`--control-mode`, `--control-group`; never
//! `--socket-mode`); each connection's peer credentials (SO_PEERCRED and
//! SO_PEERGROUPS, as the kernel recorded them at connect time) say who it is.
//! Anyone who can connect may read (list, stats, info); a request that
//! changes what is served is accepted only from the server's own user, root,
//! or a member of the control group.

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use vdisk_daemon::Error;

/// The control socket's permissions and who may change things through it.
#[derive(Clone, Debug)]
pub struct Access {
    pub mode: u32,
    /// The control group's name and id.
    pub group: Option<(String, u32)>,
    own_uid: u32,
}

impl Access {
    /// `mode` (default 0600) and the group named (looked up now).
    pub fn new(mode: Option<u32>, group: Option<&str>) -> Result<Access, Error> {
        let group = group.map(|g| group_id(g).map(|gid| (g.to_owned(), gid))).transpose()?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let own_uid = unsafe { libc::geteuid() };
        Ok(Access { mode: mode.unwrap_or(0o600), group, own_uid })
    }

    /// True when anyone but the owner may connect: the mode grants group or
    /// other write permission (what connecting to a unix socket takes).
    pub fn reaches_others(mode: u32) -> bool {
        mode & 0o022 != 0
    }

    /// Gives the bound socket (made 0600) its group and then its mode, so
    /// nobody else can connect before both are right.
    pub fn apply(&self, path: &Path) -> Result<(), Error> {
        let fail = |what: &str, e: std::io::Error| {
            Error::failed(format!("cannot {what} control socket {}", path.display())).at(path).because(e)
        };
        if let Some((name, gid)) = &self.group {
            std::os::unix::fs::chown(path, None, Some(*gid))
                .map_err(|e| fail(&format!("give group {name:?} (is the server's user a member?) to the"), e))?;
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(self.mode))
            .map_err(|e| fail(&format!("set mode {:04o} on the", self.mode), e))
    }

    /// May `peer` change exports?
    pub fn may_change(&self, peer: &Peer) -> bool {
        peer.uid == self.own_uid
            || peer.uid == 0
            || self.group.as_ref().is_some_and(|(_, g)| peer.gid == *g || peer.groups.contains(g))
    }

    /// Why `peer` was refused, for its error message.
    pub fn refusal(&self, peer: &Peer, method: &str) -> String {
        let who = match &self.group {
            Some((name, _)) => {
                format!("the server's own user (uid {}), root or members of group {name:?}", self.own_uid)
            }
            None => format!("the server's own user (uid {}) or root (or a --control-group)", self.own_uid),
        };
        format!("{method} changes what is served: only {who} may send it; you are uid {} gid {}", peer.uid, peer.gid)
    }
}

/// The process at the other end of a control connection, as the kernel saw it connect.
#[derive(Clone, Debug, Default)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: i32,
    /// Supplementary groups (SO_PEERGROUPS).
    pub groups: Vec<u32>,
}

impl Peer {
    pub fn of(stream: &UnixStream) -> std::io::Result<Peer> {
        let fd = stream.as_raw_fd();
        let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` and `len` are valid for writes of the sizes given; `fd` is an open socket.
        let r =
            unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &raw mut len) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut groups = vec![0u32; 64];
        loop {
            let mut len = (groups.len() * 4) as libc::socklen_t;
            // SAFETY: `groups` has room for `len` bytes; `fd` is an open socket.
            let r = unsafe {
                libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &raw mut len)
            };
            if r == 0 {
                groups.truncate(len as usize / 4);
                break;
            }
            let e = std::io::Error::last_os_error();
            // ERANGE: `len` now says how much room the list needs.
            if e.raw_os_error() == Some(libc::ERANGE) && (len as usize / 4) > groups.len() {
                groups.resize(len as usize / 4, 0);
                continue;
            }
            // No list (an old kernel): the primary group still counts.
            groups.clear();
            break;
        }
        Ok(Peer { uid: cred.uid, gid: cred.gid, pid: cred.pid, groups })
    }
}

/// The id of group `name` (or a number), from the system's group database.
fn group_id(name: &str) -> Result<u32, Error> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    let c = CString::new(name).map_err(|_| Error::invalid(format!("{name:?} is not a group name")))?;
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: group is plain data; all zeros is valid before getgrnam_r fills it.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and `buf` has the length given.
    let r = unsafe { libc::getgrnam_r(c.as_ptr(), &mut grp, buf.as_mut_ptr().cast(), buf.len(), &mut out) };
    if r != 0 || out.is_null() {
        return Err(Error::invalid(format!(
            "--control-group {name:?}: no such group (create it with groupadd, or give its number)"
        )));
    }
    Ok(grp.gr_gid)
}

//! What an RBD name means: `rbd:POOL/IMAGE[@SNAP][:conf=PATH][:id=NAME][:KEY=VALUE...]`,
//! as qemu spells it. `\:` and `\@` escape the separators; other `KEY=VALUE`
//! options are Ceph configuration settings (qemu passes them the same way).

use std::fmt;
use std::path::PathBuf;

use crate::{Error, Result};

/// How to reach the cluster: the configuration file, the client id and
/// further Ceph settings. Unset means librados's own defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectOptions {
    pub conf: Option<PathBuf>,
    pub id: Option<String>,
    pub extra: Vec<(String, String)>,
}

/// A parsed RBD name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub pool: String,
    pub image: String,
    pub snap: Option<String>,
    pub options: ConnectOptions,
}

/// Splits at unescaped `sep`, unescaping `\x` to `x`.
fn split(s: &str, sep: char) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => parts.last_mut().unwrap().extend(chars.next()),
            c if c == sep => parts.push(String::new()),
            c => parts.last_mut().unwrap().push(c),
        }
    }
    parts
}

/// `\x` to `x`.
fn unescape(s: &str) -> String {
    split(s, '\0').concat()
}

/// Like `split` but keeps escapes (for a first pass whose parts are split again).
fn split_raw(s: &str, sep: char) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let p = parts.last_mut().unwrap();
                p.push('\\');
                p.extend(chars.next());
            }
            c if c == sep => parts.push(String::new()),
            c => parts.last_mut().unwrap().push(c),
        }
    }
    parts
}

impl Spec {
    /// Parses `rbd:...`; `defaults` (from --ceph-conf / --ceph-id) apply where
    /// the name sets nothing itself.
    pub fn parse(name: &str, defaults: &ConnectOptions) -> Result<Spec> {
        let usage = |why: &str| {
            Error::invalid(format!(
                "{name:?} is not an RBD image name: {why} (write rbd:POOL/IMAGE, rbd:POOL/IMAGE@SNAP, \
                 optionally followed by :conf=PATH:id=NAME)"
            ))
        };
        let rest = name.strip_prefix("rbd:").ok_or_else(|| usage("it must start with rbd:"))?;
        let mut fields = split_raw(rest, ':').into_iter();
        let path = fields.next().unwrap_or_default();
        let mut options = defaults.clone();
        let (mut conf, mut id) = (None, None);
        for f in fields {
            let kv = split(&f, '=');
            let [k, v] = kv.as_slice() else {
                return Err(usage(&format!("option {f:?} is not KEY=VALUE")));
            };
            match k.as_str() {
                "conf" => conf = Some(PathBuf::from(v)),
                "id" => id = Some(v.clone()),
                "" => return Err(usage("an option has no name")),
                _ => options.extra.push((k.clone(), v.clone())),
            }
        }
        options.conf = conf.or(options.conf);
        options.id = id.or(options.id);
        let at = split_raw(&path, '@');
        let (image_path, snap) = match at.as_slice() {
            [p] => (p.clone(), None),
            [p, s] => (p.clone(), Some(unescape(s))),
            _ => return Err(usage("more than one @")),
        };
        let parts = split(&image_path, '/');
        let (pool, image) = match parts.as_slice() {
            [pool, image] => (pool.clone(), image.clone()),
            [_, _, _] => return Err(usage("RBD namespaces (POOL/NAMESPACE/IMAGE) are not supported")),
            _ => return Err(usage("it needs a pool and an image, POOL/IMAGE")),
        };
        if pool.is_empty() || image.is_empty() {
            return Err(usage("the pool or the image name is empty"));
        }
        if snap.as_deref() == Some("") {
            return Err(usage("the snapshot name after @ is empty"));
        }
        Ok(Spec { pool, image, snap, options })
    }

    /// The export name it gets by default: the image (and snapshot) name.
    pub fn export_name(&self) -> String {
        match &self.snap {
            Some(s) => format!("{}@{s}", self.image),
            None => self.image.clone(),
        }
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rbd:{}/{}", self.pool, self.image)?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_spellings() {
        let d = ConnectOptions::default();
        let s = Spec::parse("rbd:rbd/disk", &d).unwrap();
        assert_eq!((s.pool.as_str(), s.image.as_str(), s.snap.as_deref()), ("rbd", "disk", None));
        let s = Spec::parse("rbd:pool/img@snap1:conf=/etc/c.conf:id=admin:rbd_cache=false", &d).unwrap();
        assert_eq!(s.snap.as_deref(), Some("snap1"));
        assert_eq!(s.options.conf, Some(PathBuf::from("/etc/c.conf")));
        assert_eq!(s.options.id.as_deref(), Some("admin"));
        assert_eq!(s.options.extra, vec![("rbd_cache".to_owned(), "false".to_owned())]);
        assert_eq!(s.to_string(), "rbd:pool/img@snap1");
        assert_eq!(s.export_name(), "img@snap1");
        let s = Spec::parse(r"rbd:p/a\:b:conf=/x\:y", &d).unwrap();
        assert_eq!(s.image, "a:b");
        assert_eq!(s.options.conf, Some(PathBuf::from("/x:y")));
    }

    #[test]
    fn names_win_over_flags() {
        let flags = ConnectOptions { conf: Some("/flag.conf".into()), id: Some("flag".into()), extra: vec![] };
        let s = Spec::parse("rbd:p/i", &flags).unwrap();
        assert_eq!(s.options, flags);
        let s = Spec::parse("rbd:p/i:id=mine", &flags).unwrap();
        assert_eq!(s.options.id.as_deref(), Some("mine"));
        assert_eq!(s.options.conf, Some(PathBuf::from("/flag.conf")));
    }

    #[test]
    fn mistakes_say_what_to_write() {
        let d = ConnectOptions::default();
        for bad in ["rbd:", "rbd:pool", "rbd:/img", "rbd:p/i@", "rbd:p/i:conf", "rbd:a/b/c", "rbd:p/i@a@b"] {
            let e = Spec::parse(bad, &d).unwrap_err();
            assert!(e.to_string().contains("rbd:POOL/IMAGE"), "{bad}: {e}");
        }
    }
}

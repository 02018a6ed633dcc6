//! `vdisk serve`'s security options turned into the NBD server's handshake
//! policy: TLS credentials loaded (and checked) before anything listens.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use vdisk_nbd::{Policy, Tls, TlsFiles, TlsMode};

use crate::spec::ExportSpec;
use crate::Error;

/// `--tls` / `tls = "..."`: TLS on NBD.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsChoice {
    Off,
    On,
    Require,
}

/// The security settings of the server (`vdisk serve`'s TLS flags, `[server]`'s TLS keys).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TlsSettings {
    pub tls: Option<TlsChoice>,
    pub tls_certificates: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub tls_verify_peer: bool,
    pub tls_psk: Option<PathBuf>,
    /// Do not list exports.
    pub no_list: bool,
    /// Do not serve an empty export name as the first export.
    pub no_default_export: bool,
}

/// The handshake policy the flags ask for; bad or missing credentials are a usage error.
pub fn policy(a: &TlsSettings) -> Result<Policy, Error> {
    let have_creds = a.tls_certificates.is_some() || a.tls_cert.is_some() || a.tls_psk.is_some();
    let mode = match a.tls {
        Some(TlsChoice::Off) => None,
        Some(TlsChoice::On) => Some(TlsMode::On),
        Some(TlsChoice::Require) => Some(TlsMode::Require),
        None if have_creds => Some(TlsMode::Require),
        None => None,
    };
    let verify = a.tls_verify_peer || a.tls_ca.is_some();
    let tls = match mode {
        None if have_creds || verify => {
            return Err(Error::invalid(
                "TLS credentials were given with --tls=off; drop them or use --tls=on or --tls=require",
            ))
        }
        None => None,
        Some(mode) => Some(Arc::new(load(mode, a, verify)?)),
    };
    Ok(Policy { tls, list: !a.no_list, default_export: !a.no_default_export })
}

/// `--export-allow NAME=PATTERN` flags as (name, pattern), each pattern checked.
pub fn export_allow(flags: &[String]) -> Result<Vec<(String, String)>, Error> {
    flags
        .iter()
        .map(|f| {
            let Some((name, pattern)) = f.split_once('=').filter(|(n, p)| !n.is_empty() && !p.is_empty()) else {
                return Err(Error::invalid(format!(
                    "--export-allow {f:?} is not NAME=PATTERN (e.g. --export-allow disk=CN=vm-* or disk='*.example.org')"
                )));
            };
            vdisk_nbd::allow::Allow::new(&[pattern]).map_err(|e| Error::invalid(format!("--export-allow {f}")).because(e))?;
            Ok((name.to_owned(), pattern.to_owned()))
        })
        .collect()
}

/// Allow lists only work when TLS tells the server who each client is.
pub fn check_allow<'a>(policy: &Policy, specs: impl Iterator<Item = &'a ExportSpec>) -> Result<(), Error> {
    let identifies = policy.tls.as_ref().is_some_and(|t| t.identifies_clients());
    for spec in specs {
        if !spec.allow.is_empty() && !identifies {
            let name = spec.export_name();
            return Err(Error::invalid(format!(
                "export {name:?} has an allow list, but {}",
                crate::daemon::NO_IDENTITIES
            )));
        }
    }
    Ok(())
}

fn load(mode: TlsMode, a: &TlsSettings, verify: bool) -> Result<Tls, Error> {
    if let Some(file) = &a.tls_psk {
        return Tls::psk(mode, file).map_err(|e| credentials(&e));
    }
    if let Some(dir) = &a.tls_certificates {
        let psk = dir.join("keys.psk");
        if psk.exists() {
            if dir.join("server-cert.pem").exists() {
                return Err(Error::invalid(format!(
                    "{} holds both keys.psk and server-cert.pem: give --tls-psk {} for pre-shared keys, \
                     or move keys.psk away for certificates",
                    dir.display(),
                    psk.display()
                )));
            }
            if verify {
                return Err(Error::invalid(format!(
                    "{} holds pre-shared keys (keys.psk), which authenticate clients already: \
                     drop --tls-verify-peer/--tls-ca",
                    dir.display()
                )));
            }
            return Tls::psk(mode, &psk).map_err(|e| credentials(&e));
        }
    }
    let files = match (&a.tls_certificates, &a.tls_cert, &a.tls_key) {
        (Some(dir), _, _) => {
            let need = |name: &str| {
                let p = dir.join(name);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(Error::invalid(format!(
                        "{} is missing: --tls-certificates {} must hold server-cert.pem and server-key.pem \
                         (and ca-cert.pem for --tls-verify-peer), or keys.psk for pre-shared keys",
                        p.display(),
                        dir.display()
                    )))
                }
            };
            let ca = match (&a.tls_ca, verify) {
                (Some(ca), _) => Some(ca.clone()),
                (None, true) => Some(need("ca-cert.pem")?),
                (None, false) => None,
            };
            TlsFiles { cert: need("server-cert.pem")?, key: need("server-key.pem")?, client_ca: ca }
        }
        (None, Some(cert), Some(key)) => {
            let ca = match (&a.tls_ca, verify) {
                (Some(ca), _) => Some(ca.clone()),
                (None, true) => {
                    return Err(Error::invalid(
                        "--tls-verify-peer needs the CA that signs client certificates: --tls-ca FILE",
                    ))
                }
                (None, false) => None,
            };
            TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: ca }
        }
        _ => {
            return Err(Error::invalid(
                "TLS needs a certificate: --tls-certificates DIR (server-cert.pem, server-key.pem) \
                 or --tls-cert FILE --tls-key FILE; or pre-shared keys: --tls-psk FILE",
            ))
        }
    };
    for p in [Some(&files.cert), Some(&files.key), files.client_ca.as_ref()].into_iter().flatten() {
        exists(p)?;
    }
    Tls::new(mode, &files).map_err(|e| credentials(&e))
}

fn exists(p: &Path) -> Result<(), Error> {
    std::fs::metadata(p).map(|_| ()).map_err(|e| Error::invalid(format!("cannot use {}", p.display())).at(p).because(e))
}

/// TLS credentials that cannot be used, as the daemon's error: the message,
/// and what caused it kept as its cause.
fn credentials(e: &vdisk_nbd::tls::CredentialError) -> Error {
    let error = Error::invalid(e.to_string());
    match e.cause() {
        Some(cause) => error.because_shared(cause),
        None => error,
    }
}

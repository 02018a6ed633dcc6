//! `vdisk serve`'s security options turned into the NBD server's handshake
//! policy: TLS credentials loaded (and checked) before anything listens.

use std::path::Path;
use std::sync::Arc;

use vdisk_nbd::{Policy, Tls, TlsFiles, TlsMode};

use crate::cli::{SecurityArgs, TlsArg};
use crate::daemon::ExportSpec;
use crate::Failure;

/// The handshake policy the flags ask for; bad or missing credentials are a usage error.
pub fn policy(a: &SecurityArgs) -> Result<Policy, Failure> {
    let have_creds = a.tls_certificates.is_some() || a.tls_cert.is_some() || a.tls_psk.is_some();
    let mode = match a.tls {
        Some(TlsArg::Off) => None,
        Some(TlsArg::On) => Some(TlsMode::On),
        Some(TlsArg::Require) => Some(TlsMode::Require),
        None if have_creds => Some(TlsMode::Require),
        None => None,
    };
    let verify = a.tls_verify_peer || a.tls_ca.is_some();
    let tls = match mode {
        None if have_creds || verify => {
            return Err(Failure::usage(
                "TLS credentials were given with --tls=off; drop them or use --tls=on or --tls=require",
            ))
        }
        None => None,
        Some(mode) => Some(Arc::new(load(mode, a, verify)?)),
    };
    Ok(Policy { tls, list: !a.no_list, default_export: !a.no_default_export })
}

/// `--export-allow NAME=PATTERN` flags as (name, pattern), each pattern checked.
pub fn export_allow(flags: &[String]) -> Result<Vec<(String, String)>, Failure> {
    flags
        .iter()
        .map(|f| {
            let Some((name, pattern)) = f.split_once('=').filter(|(n, p)| !n.is_empty() && !p.is_empty()) else {
                return Err(Failure::usage(format!(
                    "--export-allow {f:?} is not NAME=PATTERN (e.g. --export-allow disk=CN=vm-* or disk='*.example.org')"
                )));
            };
            vdisk_nbd::allow::Allow::new(&[pattern]).map_err(|e| Failure::usage(format!("--export-allow {f}: {e}")))?;
            Ok((name.to_owned(), pattern.to_owned()))
        })
        .collect()
}

/// Allow lists only work when TLS tells the server who each client is.
pub fn check_allow<'a>(policy: &Policy, specs: impl Iterator<Item = &'a ExportSpec>) -> Result<(), Failure> {
    let identifies = policy.tls.as_ref().is_some_and(|t| t.identifies_clients());
    for spec in specs {
        if !spec.allow.is_empty() && !identifies {
            let name = spec.name.clone().unwrap_or_else(|| crate::daemon::export_name(&spec.image));
            return Err(Failure::usage(format!(
                "export {name:?} has an allow list, but {}",
                crate::daemon::NO_IDENTITIES
            )));
        }
    }
    Ok(())
}

fn load(mode: TlsMode, a: &SecurityArgs, verify: bool) -> Result<Tls, Failure> {
    if let Some(file) = &a.tls_psk {
        return Tls::psk(mode, file).map_err(|e| Failure::usage(e.to_string()));
    }
    if let Some(dir) = &a.tls_certificates {
        let psk = dir.join("keys.psk");
        if psk.exists() {
            if dir.join("server-cert.pem").exists() {
                return Err(Failure::usage(format!(
                    "{} holds both keys.psk and server-cert.pem: give --tls-psk {} for pre-shared keys, \
                     or move keys.psk away for certificates",
                    dir.display(),
                    psk.display()
                )));
            }
            if verify {
                return Err(Failure::usage(format!(
                    "{} holds pre-shared keys (keys.psk), which authenticate clients already: \
                     drop --tls-verify-peer/--tls-ca",
                    dir.display()
                )));
            }
            return Tls::psk(mode, &psk).map_err(|e| Failure::usage(e.to_string()));
        }
    }
    let files = match (&a.tls_certificates, &a.tls_cert, &a.tls_key) {
        (Some(dir), _, _) => {
            let need = |name: &str| {
                let p = dir.join(name);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(Failure::usage(format!(
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
                    return Err(Failure::usage(
                        "--tls-verify-peer needs the CA that signs client certificates: --tls-ca FILE",
                    ))
                }
                (None, false) => None,
            };
            TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: ca }
        }
        _ => {
            return Err(Failure::usage(
                "TLS needs a certificate: --tls-certificates DIR (server-cert.pem, server-key.pem) \
                 or --tls-cert FILE --tls-key FILE; or pre-shared keys: --tls-psk FILE",
            ))
        }
    };
    for p in [Some(&files.cert), Some(&files.key), files.client_ca.as_ref()].into_iter().flatten() {
        exists(p)?;
    }
    Tls::new(mode, &files).map_err(|e| Failure::usage(e.to_string()))
}

fn exists(p: &Path) -> Result<(), Failure> {
    std::fs::metadata(p).map(|_| ()).map_err(|e| Failure::usage(format!("cannot use {}: {e}", p.display())))
}

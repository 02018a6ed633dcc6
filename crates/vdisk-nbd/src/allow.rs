//! Who may open an export: a client's identity (what TLS proved about it) and
//! the export's allow list of patterns.
//!
//! Owns the pattern syntax and matching, nothing else: the handshake asks
//! [`Allow::admits`] and answers a refused client exactly as it answers for an
//! export that does not exist. An export without a list admits everyone.
//!
//! Syntax of one pattern (a glob: `*` any run of characters, `?` one; the rest literal):
//! - `ATTR=GLOB[,ATTR=GLOB...]` (it has a `=`): the certificate's subject. Every
//!   term must match an attribute of that type (`CN`, `O`, `OU`, `C`, `L`, `ST`,
//!   `emailAddress`, ...; the type's case is ignored): `CN=vm-*`, `O=Example,CN=db?`.
//! - `GLOB` (no `=`): one of the client's names: a subject alternative name of its
//!   certificate (DNS name, e-mail, URI, IP address as text; DNS names compare
//!   without case) or its TLS-PSK username: `*.example.org`, `alice`.
//!
//! Values compare exactly otherwise (case matters in CN and PSK usernames).

use std::fmt;

/// What TLS proved about a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerIdentity {
    /// A client certificate that chained to the server's client CA.
    Certificate {
        /// Subject attributes in order, as (type, value): ("CN", "vm-1").
        subject: Vec<(String, String)>,
        /// Subject alternative names as text (DNS, e-mail, URI, IP).
        names: Vec<String>,
        /// DNS names among `names` (matched without case).
        dns: Vec<String>,
    },
    /// A TLS-PSK username from the server's key file.
    Psk(String),
}

impl PeerIdentity {
    /// Reads a verified end-entity certificate (DER). None if it cannot be parsed.
    pub fn from_certificate(der: &[u8]) -> Option<PeerIdentity> {
        use x509_parser::prelude::*;
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let registry = x509_parser::objects::oid_registry();
        let subject = cert
            .subject()
            .iter_attributes()
            .filter_map(|a| {
                let ty = x509_parser::objects::oid2abbrev(a.attr_type(), registry)
                    .map(str::to_owned)
                    .unwrap_or_else(|_| a.attr_type().to_id_string());
                Some((ty, a.as_str().ok()?.to_owned()))
            })
            .collect();
        let (mut names, mut dns) = (Vec::new(), Vec::new());
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::DNSName(d) => {
                        dns.push(d.to_string());
                        names.push(d.to_string());
                    }
                    GeneralName::RFC822Name(s) | GeneralName::URI(s) => names.push(s.to_string()),
                    GeneralName::IPAddress(b) => match b.len() {
                        4 => names.push(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
                        16 => names.push(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
                        _ => {}
                    },
                    _ => {}
                }
            }
        }
        Some(PeerIdentity::Certificate { subject, names, dns })
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerIdentity::Certificate { subject, names, .. } => {
                let dn: Vec<String> = subject.iter().map(|(t, v)| format!("{t}={v}")).collect();
                write!(f, "certificate {:?}", dn.join(","))?;
                if !names.is_empty() {
                    write!(f, " ({})", names.join(", "))?;
                }
                Ok(())
            }
            PeerIdentity::Psk(user) => write!(f, "PSK user {user:?}"),
        }
    }
}

/// One checked pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    /// Every (type, glob) must match a subject attribute.
    Subject(Vec<(String, String)>),
    /// A SAN or a PSK username.
    Name(String),
}

/// An export's allow list: empty admits every client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allow {
    patterns: Vec<Pattern>,
    text: Vec<String>,
}

impl Allow {
    /// Checks the patterns; the error says which one and why.
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Result<Allow, String> {
        let mut allow = Allow::default();
        for p in patterns {
            let p = p.as_ref();
            allow.patterns.push(parse(p)?);
            allow.text.push(p.to_owned());
        }
        Ok(allow)
    }

    /// No list: everyone who passed the handshake's TLS policy.
    pub fn is_open(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The patterns as given.
    pub fn patterns(&self) -> &[String] {
        &self.text
    }

    /// May a client with this identity (None: no TLS, or no client certificate) open the export?
    pub fn admits(&self, who: Option<&PeerIdentity>) -> bool {
        if self.is_open() {
            return true;
        }
        let Some(who) = who else { return false };
        self.patterns.iter().any(|p| matches(p, who))
    }
}

fn parse(p: &str) -> Result<Pattern, String> {
    if p.is_empty() || p.chars().any(char::is_control) {
        return Err(format!("allow pattern {p:?} is empty or has control characters"));
    }
    if !p.contains('=') {
        return Ok(Pattern::Name(p.to_owned()));
    }
    let mut terms = Vec::new();
    for term in p.split(',') {
        let Some((ty, glob)) = term.split_once('=') else {
            return Err(format!(
                "allow pattern {p:?}: {term:?} is not ATTR=GLOB (subject patterns are like CN=vm-* or O=Example,CN=db?)"
            ));
        };
        let ty = ty.trim();
        if ty.is_empty() || !ty.chars().all(|c| c.is_ascii_alphanumeric() || c == '.') || glob.is_empty() {
            return Err(format!(
                "allow pattern {p:?}: {term:?} is not ATTR=GLOB (subject patterns are like CN=vm-* or O=Example,CN=db?)"
            ));
        }
        terms.push((ty.to_owned(), glob.to_owned()));
    }
    Ok(Pattern::Subject(terms))
}

fn matches(p: &Pattern, who: &PeerIdentity) -> bool {
    match (p, who) {
        (Pattern::Name(g), PeerIdentity::Psk(user)) => glob(g.as_bytes(), user.as_bytes()),
        (Pattern::Name(g), PeerIdentity::Certificate { names, dns, .. }) => {
            let lower = g.to_ascii_lowercase();
            dns.iter().any(|d| glob(lower.as_bytes(), d.to_ascii_lowercase().as_bytes()))
                || names.iter().any(|n| glob(g.as_bytes(), n.as_bytes()))
        }
        (Pattern::Subject(terms), PeerIdentity::Certificate { subject, .. }) => terms
            .iter()
            .all(|(ty, g)| subject.iter().any(|(t, v)| t.eq_ignore_ascii_case(ty) && glob(g.as_bytes(), v.as_bytes()))),
        (Pattern::Subject(_), PeerIdentity::Psk(_)) => false,
    }
}

/// `*` matches any run of bytes, `?` one byte; iterative, with one backtrack point.
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: &str, dns: &[&str]) -> PeerIdentity {
        PeerIdentity::Certificate {
            subject: vec![("O".into(), "Example".into()), ("CN".into(), cn.into())],
            names: dns.iter().map(|s| s.to_string()).collect(),
            dns: dns.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn globs() {
        assert!(glob(b"vm-*", b"vm-1") && glob(b"vm-*", b"vm-") && !glob(b"vm-*", b"vm"));
        assert!(glob(b"*.example.org", b"a.b.example.org") && !glob(b"*.example.org", b"example.org"));
        assert!(glob(b"a?c", b"abc") && !glob(b"a?c", b"ac") && glob(b"*", b"") && glob(b"**x", b"yx"));
        assert!(glob(b"a*b*c", b"a-b-b-c") && !glob(b"a*b*c", b"a-b-b-"));
    }

    #[test]
    fn lists_admit_whom_they_name() {
        let open = Allow::new::<&str>(&[]).unwrap();
        assert!(open.admits(None));
        let a = Allow::new(&["CN=vm-*", "*.example.org", "alice"]).unwrap();
        assert!(!a.admits(None));
        assert!(a.admits(Some(&cert("vm-7", &[]))));
        assert!(!a.admits(Some(&cert("db-1", &[]))));
        assert!(a.admits(Some(&cert("db-1", &["DB.Example.ORG"]))), "DNS names compare without case");
        assert!(a.admits(Some(&PeerIdentity::Psk("alice".into()))));
        assert!(!a.admits(Some(&PeerIdentity::Psk("Alice".into()))));
        assert!(!a.admits(Some(&PeerIdentity::Psk("CN=vm-1".into()))), "subject patterns never match a PSK user");
        let both = Allow::new(&["o=Example,cn=db?"]).unwrap();
        assert!(both.admits(Some(&cert("db1", &[]))) && !both.admits(Some(&cert("db10", &[]))));
        assert!(Allow::new(&["CN="]).is_err() && Allow::new(&["=x"]).is_err() && Allow::new(&[""]).is_err());
        assert!(Allow::new(&["CN=a,b"]).unwrap_err().contains("ATTR=GLOB"));
    }
}

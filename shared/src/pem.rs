//! Certificates and private keys read from PEM files: the allocator's
//! server certificate, key and client CA, and the agent's CA files and
//! client identities for its allocator and Redis links.
//!
//! Every error names the setting (`what`, e.g. `ALLOCATOR_TLS_KEY`) and the
//! file, so a wrong path or a file that is not PEM is clear at start; none
//! quotes the file's contents, because a key file's bytes are secret.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};

/// Why a PEM file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    /// The file could not be read (missing, unreadable).
    #[error("cannot read {what} {}: {source}", path.display())]
    Read { what: &'static str, path: PathBuf, source: std::io::Error },
    /// A certificate block is malformed (bad base64, no end line).
    #[error("{what} {} is not PEM certificates: {reason}", path.display())]
    NotCertificates { what: &'static str, path: PathBuf, reason: String },
    /// The file holds no certificate block (empty, or something else).
    #[error("{what} {} holds no certificate", path.display())]
    NoCertificate { what: &'static str, path: PathBuf },
    /// The file holds no private key block. The parser's reason is left
    /// out: it could quote part of the key.
    #[error("{what} {} holds no PEM private key", path.display())]
    NoPrivateKey { what: &'static str, path: PathBuf },
}

/// The callers keep their errors as text (a start error is printed, a
/// reload failure is logged); `?` turns a `PemError` into its message.
impl From<PemError> for String {
    fn from(e: PemError) -> String {
        e.to_string()
    }
}

/// The bytes of the file `what` names (for a library that parses them
/// itself, after [`parse_certs`] or [`parse_private_key`] checked them).
pub fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, PemError> {
    std::fs::read(path).map_err(|source| PemError::Read { what, path: path.to_path_buf(), source })
}

/// The certificates of a PEM file, in file order (a chain: leaf first);
/// at least one.
pub fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    parse_certs(what, path, &read(what, path)?)
}

/// The certificates of `bytes`, read from `path`; at least one.
pub fn parse_certs(
    what: &'static str,
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PemError::NotCertificates { what, path: path.to_path_buf(), reason: e.to_string() })?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate { what, path: path.to_path_buf() });
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(what: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, PemError> {
    parse_private_key(what, path, &read(what, path)?)
}

/// The first private key of `bytes`, read from `path`.
pub fn parse_private_key(
    what: &'static str,
    path: &Path,
    bytes: &[u8],
) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(bytes)
        .map_err(|_| PemError::NoPrivateKey { what, path: path.to_path_buf() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory with a fresh certificate (`cert.pem`), its key
    /// (`key.pem`), an empty file and a malformed certificate block.
    fn files() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        std::fs::write(dir.path().join("cert.pem"), made.cert.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), made.signing_key.serialize_pem()).unwrap();
        std::fs::write(dir.path().join("empty.pem"), "").unwrap();
        let bad = "-----BEGIN CERTIFICATE-----\nnot*base64*secret\n-----END CERTIFICATE-----\n";
        std::fs::write(dir.path().join("bad.pem"), bad).unwrap();
        dir
    }

    #[test]
    fn a_good_file_gives_its_certificate_and_key() {
        let dir = files();
        let certs = certs("TEST_CERT", &dir.path().join("cert.pem")).unwrap();
        assert_eq!(certs.len(), 1);
        private_key("TEST_KEY", &dir.path().join("key.pem")).unwrap();
        // Read once, parsed from the bytes: the same answer.
        let bytes = read("TEST_CERT", &dir.path().join("cert.pem")).unwrap();
        assert_eq!(parse_certs("TEST_CERT", &dir.path().join("cert.pem"), &bytes).unwrap(), certs);
    }

    /// What [`certs`] answers for `file` of [`files`], with the path as
    /// errors show it.
    fn cert_error(dir: &tempfile::TempDir, file: &str) -> (PemError, String) {
        let path = dir.path().join(file);
        (certs("TEST_CERT", &path).unwrap_err(), path.display().to_string())
    }

    #[test]
    fn an_empty_file_holds_no_certificate_and_no_key() {
        let dir = files();
        let (e, path) = cert_error(&dir, "empty.pem");
        assert!(matches!(e, PemError::NoCertificate { .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("TEST_CERT {path} holds no certificate"));
        let e = private_key("TEST_KEY", &dir.path().join("empty.pem")).unwrap_err();
        assert_eq!(e.to_string(), format!("TEST_KEY {path} holds no PEM private key"));
    }

    #[test]
    fn a_missing_file_is_named_with_the_reason() {
        let dir = files();
        let (e, path) = cert_error(&dir, "none.pem");
        let key_e = private_key("TEST_CERT", &dir.path().join("none.pem")).unwrap_err();
        for e in [e, key_e] {
            assert!(matches!(e, PemError::Read { .. }), "{e:?}");
            let text = e.to_string();
            assert!(text.starts_with(&format!("cannot read TEST_CERT {path}: ")), "{text}");
        }
    }

    #[test]
    fn bad_pem_is_named_and_its_contents_are_not_echoed() {
        let dir = files();
        let (e, path) = cert_error(&dir, "bad.pem");
        assert!(matches!(e, PemError::NotCertificates { .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.starts_with(&format!("TEST_CERT {path} is not PEM certificates: ")), "{text}");
        assert!(!text.contains("secret"), "{text}");
        // A certificate where a key belongs is no key.
        let e = private_key("TEST_KEY", &dir.path().join("cert.pem")).unwrap_err();
        assert!(matches!(e, PemError::NoPrivateKey { .. }), "{e:?}");
        assert!(e.to_string().contains("cert.pem"), "{e}");
    }
}

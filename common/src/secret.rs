//! [`Secret`]: a credential held in memory that never prints itself, and the one place that reads
//! credentials from the operator (an environment variable or a file named by `NAME_FILE`).
//!
//! Every secret of the job (the trainer and engine credentials, the API token, the read-only
//! token) is a `Secret`, so a `Debug` of a configuration, a panic message or a `tracing` field
//! shows `Secret(<redacted>)`, never the bytes. Operator-given secrets must be at least
//! [`MIN_SECRET_LEN`] characters: a challenge and its answer sniffed off a plaintext control
//! channel let an attacker test guesses offline at BLAKE3 speed, so a short token is a weak one.

use std::path::Path;

/// Shortest secret accepted from an operator: 16 characters. A floor against typos and
/// passwords, not a strength guarantee: random hex carries 4 bits a character, so give 32 hex
/// characters (`openssl rand -hex 16`) or more for 128 bits.
pub const MIN_SECRET_LEN: usize = 16;

/// A credential. `Debug` and `Display` print `Secret(<redacted>)`; [`Secret::expose`] is the
/// only way to the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.to_string())
    }
}

/// Why an operator's secret was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Neither `NAME` nor `NAME_FILE` is set.
    #[error("{name} is not set (set it, or {name}_FILE to a file holding it)")]
    Missing {
        /// The variable.
        name: String,
    },
    /// Both `NAME` and `NAME_FILE` are set.
    #[error("both {name} and {name}_FILE are set; set one")]
    Both {
        /// The variable.
        name: String,
    },
    /// The file could not be read.
    #[error("reading {name}_FILE ({path}): {source}")]
    File {
        /// The variable.
        name: String,
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Shorter than [`MIN_SECRET_LEN`].
    #[error(
        "{name} is {len} characters; a secret needs at least {MIN_SECRET_LEN} (e.g. `openssl rand -hex 32`)"
    )]
    TooShort {
        /// The variable.
        name: String,
        /// Its length.
        len: usize,
    },
}

impl Secret {
    /// The secret's text (to derive keys from, or to hand to a child that needs it).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A fresh random secret: 32 hex characters (128 bits).
    pub fn random() -> Secret {
        let bytes: [u8; 16] = rand::random();
        Secret(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Reads the secret `name` as an operator gives it: the variable `name`, or the file that
    /// `name_FILE` names (one trailing newline dropped). `Ok(None)` when neither is set. `env`
    /// looks a variable up (`std::env::var` in a binary, a map in tests).
    pub fn from_env_or_file(
        name: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Secret>, SecretError> {
        let file_var = format!("{name}_FILE");
        let direct = env(name).filter(|v| !v.is_empty());
        let file = env(&file_var).filter(|v| !v.is_empty());
        let text = match (direct, file) {
            (Some(_), Some(_)) => {
                return Err(SecretError::Both { name: name.into() });
            }
            (Some(v), None) => v,
            (None, Some(path)) => read_secret_file(name, Path::new(&path))?,
            (None, None) => return Ok(None),
        };
        let secret = Secret(text);
        secret.check_strength(name)?;
        Ok(Some(secret))
    }

    /// [`Secret::from_env_or_file`] for a secret that must be given.
    pub fn required(
        name: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Secret, SecretError> {
        Self::from_env_or_file(name, env)?.ok_or_else(|| SecretError::Missing { name: name.into() })
    }

    /// Refuses a secret shorter than [`MIN_SECRET_LEN`] (`name` says which in the error).
    pub fn check_strength(&self, name: &str) -> Result<(), SecretError> {
        let len = self.0.chars().count();
        if len < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                name: name.into(),
                len,
            });
        }
        Ok(())
    }

    /// Whether `self` and `other` are the same secret, in time independent of where they differ.
    pub fn same_as(&self, other: &Secret) -> bool {
        blake3::hash(self.0.as_bytes()) == blake3::hash(other.0.as_bytes())
    }
}

fn read_secret_file(name: &str, path: &Path) -> Result<String, SecretError> {
    let mut text = std::fs::read_to_string(path).map_err(|source| SecretError::File {
        name: name.into(),
        path: path.display().to_string(),
        source,
    })?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env<'a>(m: &'a HashMap<&str, String>) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| m.get(k).cloned()
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let s = Secret::from("hunter2-hunter2-hunter2");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert!(!format!("{:?}", Some(&s)).contains("hunter2"));
    }

    #[test]
    fn reads_env_or_file_and_refuses_short_or_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tok");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        let mut m = HashMap::new();
        assert!(Secret::from_env_or_file("T", &env(&m)).unwrap().is_none());
        assert!(matches!(
            Secret::required("T", &env(&m)),
            Err(SecretError::Missing { .. })
        ));
        m.insert("T_FILE", path.display().to_string());
        let s = Secret::required("T", &env(&m)).unwrap();
        assert_eq!(s.expose(), "0123456789abcdef0123");
        m.insert("T", "short".into());
        assert!(matches!(
            Secret::required("T", &env(&m)),
            Err(SecretError::Both { .. })
        ));
        m.remove("T_FILE");
        let err = Secret::required("T", &env(&m)).unwrap_err();
        assert!(err.to_string().contains("at least 16"), "{err}");
        assert!(!err.to_string().contains("short"), "{err}");
        m.insert("T_FILE", dir.path().join("nope").display().to_string());
        m.remove("T");
        assert!(matches!(
            Secret::required("T", &env(&m)),
            Err(SecretError::File { .. })
        ));
    }

    #[test]
    fn random_secrets_are_long_enough_and_differ() {
        let (a, b) = (Secret::random(), Secret::random());
        a.check_strength("a").unwrap();
        assert!(!a.same_as(&b));
        assert!(a.same_as(&a.clone()));
    }
}

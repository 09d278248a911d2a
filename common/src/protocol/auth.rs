//! Job-token authentication of a control connection.
//!
//! The controller opens with a random 32-byte nonce; the worker answers with
//! `blake3::keyed_hash(derive_key(token), nonce)`. The token itself never crosses the wire, a
//! recorded answer is useless against another nonce, and the comparison is constant-time
//! (`blake3::Hash`'s `PartialEq`).

/// Context string for deriving the MAC key from the job token.
const CONTEXT: &str = "weightsync control channel v1 job token";

fn key(token: &str) -> [u8; 32] {
    blake3::derive_key(CONTEXT, token.as_bytes())
}

/// A fresh random nonce.
pub fn nonce() -> [u8; 32] {
    rand::random()
}

/// The proof a worker sends for `nonce`.
pub fn prove(token: &str, nonce: &[u8; 32]) -> [u8; 32] {
    *blake3::keyed_hash(&key(token), nonce).as_bytes()
}

/// Whether `proof` answers `nonce` for `token` (constant time).
pub fn verify(token: &str, nonce: &[u8; 32], proof: &[u8; 32]) -> bool {
    blake3::keyed_hash(&key(token), nonce) == blake3::Hash::from(*proof)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proof_checks_token_and_nonce() {
        let n = nonce();
        let p = prove("secret", &n);
        assert!(verify("secret", &n, &p));
        assert!(!verify("other", &n, &p));
        assert!(!verify("secret", &nonce(), &p));
    }
}

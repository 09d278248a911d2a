//! Mutual, role-bound authentication of a control connection.
//!
//! ```text
//! controller -> worker   Challenge { nonce_c }
//! worker -> controller   Hello { role, nonce_w, proof = MAC(worker key of role, role | nonce_c) }
//! controller -> worker   Job { .., proof = MAC(controller key of role, role | nonce_w | nonce_c) }
//! ```
//! Each role (trainer, rollout/engine) has a secret of its own, and the MAC key is derived from
//! the secret *and* the role, so an engine's credential proves nothing about the trainer role
//! even if the operator chose one secret for both. The controller answers with a proof of its
//! own over the worker's nonce, and the worker checks it before it sends its registration, so an
//! impostor that does not hold the role's secret cannot pose as the controller (it could relay a
//! challenge to the real one, but it cannot forge the answer to the worker's nonce without it,
//! and a relayed answer gives it nothing: after the handshake, plaintext frames are only as
//! safe as the network; TLS covers that).
//!
//! Secrets never cross the wire, a recorded answer is useless against another nonce, and the
//! comparisons are constant-time (`blake3::Hash`'s `PartialEq`).

use super::messages::WorkerRole;

/// Context of the key a worker proves with.
const WORKER_CONTEXT: &str = "weightsync control channel v2 worker proof";
/// Context of the key the controller answers with.
const CONTROLLER_CONTEXT: &str = "weightsync control channel v2 controller proof";

fn role_byte(role: WorkerRole) -> u8 {
    match role {
        WorkerRole::Trainer => 1,
        WorkerRole::Rollout => 2,
    }
}

fn mac(context: &str, secret: &str, role: WorkerRole, parts: &[&[u8; 32]]) -> blake3::Hash {
    let mut material = Vec::with_capacity(secret.len() + 1);
    material.push(role_byte(role));
    material.extend_from_slice(secret.as_bytes());
    let key = blake3::derive_key(context, &material);
    let mut h = blake3::Hasher::new_keyed(&key);
    h.update(&[role_byte(role)]);
    for p in parts {
        h.update(*p);
    }
    h.finalize()
}

/// A fresh random nonce.
pub fn nonce() -> [u8; 32] {
    rand::random()
}

/// The proof a worker of `role` sends for the controller's `nonce`.
pub fn prove(secret: &str, role: WorkerRole, nonce: &[u8; 32]) -> [u8; 32] {
    *mac(WORKER_CONTEXT, secret, role, &[nonce]).as_bytes()
}

/// Whether `proof` answers `nonce` for `role` under `secret` (constant time).
pub fn verify(secret: &str, role: WorkerRole, nonce: &[u8; 32], proof: &[u8; 32]) -> bool {
    mac(WORKER_CONTEXT, secret, role, &[nonce]) == blake3::Hash::from(*proof)
}

/// The controller's answer to a worker of `role` that sent `worker_nonce` in reply to
/// `controller_nonce`.
pub fn answer(
    secret: &str,
    role: WorkerRole,
    worker_nonce: &[u8; 32],
    controller_nonce: &[u8; 32],
) -> [u8; 32] {
    *mac(
        CONTROLLER_CONTEXT,
        secret,
        role,
        &[worker_nonce, controller_nonce],
    )
    .as_bytes()
}

/// Whether the controller's `proof` shows it holds `role`'s secret (constant time).
pub fn check_answer(
    secret: &str,
    role: WorkerRole,
    worker_nonce: &[u8; 32],
    controller_nonce: &[u8; 32],
    proof: &[u8; 32],
) -> bool {
    mac(
        CONTROLLER_CONTEXT,
        secret,
        role,
        &[worker_nonce, controller_nonce],
    ) == blake3::Hash::from(*proof)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proof_checks_secret_role_and_nonce() {
        let n = nonce();
        let p = prove("secret", WorkerRole::Trainer, &n);
        assert!(verify("secret", WorkerRole::Trainer, &n, &p));
        assert!(!verify("other", WorkerRole::Trainer, &n, &p));
        assert!(!verify("secret", WorkerRole::Rollout, &n, &p));
        assert!(!verify("secret", WorkerRole::Trainer, &nonce(), &p));
    }

    #[test]
    fn the_controller_answer_is_not_a_worker_proof() {
        let (c, w) = (nonce(), nonce());
        let a = answer("s", WorkerRole::Rollout, &w, &c);
        assert!(check_answer("s", WorkerRole::Rollout, &w, &c, &a));
        assert!(!check_answer("s", WorkerRole::Trainer, &w, &c, &a));
        assert!(!check_answer("t", WorkerRole::Rollout, &w, &c, &a));
        assert!(!check_answer("s", WorkerRole::Rollout, &c, &w, &a));
        // A worker's proof reflected back is no answer.
        let p = prove("s", WorkerRole::Rollout, &w);
        assert!(!check_answer("s", WorkerRole::Rollout, &w, &c, &p));
    }
}

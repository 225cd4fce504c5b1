//! Randomness from the operating system, for what the control plane makes
//! up: ids, secrets, session-key seeds, MACs, credential ids, and the
//! random choices of the broker.

use otherix_core::MacAddr;

/// `N` random bytes.
pub fn bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // The OS random source failing is not recoverable for a CA/token issuer.
    getrandom::fill(&mut b).expect("the operating system's random source failed");
    b
}

/// A 64-bit id in hex: networks, token ids, key ids, the cluster id.
pub fn short_id() -> String {
    hex::encode(bytes::<8>())
}

/// A 128-bit id in hex: VM ids and credential ids (`jti`).
pub fn long_id() -> String {
    hex::encode(bytes::<16>())
}

/// A locally administered unicast MAC.
pub fn mac() -> MacAddr {
    MacAddr::from_random(bytes::<5>())
}

/// Two independent random numbers (power-of-two choices).
pub fn pair() -> (u64, u64) {
    let r = bytes::<16>();
    let (a, b) = r.split_at(8);
    // Both halves are 8 bytes long.
    (
        u64::from_le_bytes(a.try_into().expect("8 bytes")),
        u64::from_le_bytes(b.try_into().expect("8 bytes")),
    )
}

/// An index below `n` (`n` > 0), uniform enough for picking among a few
/// gateways.
pub fn index(n: usize) -> usize {
    (u64::from_le_bytes(bytes::<8>()) % n.max(1) as u64) as usize
}

//! Randomness for what the control plane makes up: from the operating
//! system for secrets, session-key seeds, MACs and the 64-bit ids; from a
//! generator of each thread's own, seeded by the operating system, for the
//! 128-bit ids (VMs', credentials') and the broker's random choices: what
//! every broker call draws.
//!
//! The broker draws twice a credential. Each draw from the operating
//! system is a system call (`getrandom`; the C library here has no
//! in-process one), about 1.5 % of the control plane's time at 20,000
//! credentials a second. The thread's generator is ChaCha12 (as `rand`'s
//! `ThreadRng`), seeded with 32 bytes from the operating system and seeded
//! again after every 64 KiB it gives.

use std::cell::RefCell;

use otherix_core::MacAddr;
use rand_chacha::ChaCha12Rng;
use rand_core::{RngCore as _, SeedableRng as _};

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
    hex::encode(drawn::<16>())
}

/// A locally administered unicast MAC.
pub fn mac() -> MacAddr {
    MacAddr::from_random(bytes::<5>())
}

/// Two independent random numbers (power-of-two choices).
pub fn pair() -> (u64, u64) {
    let r = drawn::<16>();
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
    (u64::from_le_bytes(drawn::<8>()) % n.max(1) as u64) as usize
}

/// How many bytes a thread's generator gives before it is seeded again.
const RESEED_AFTER: usize = 64 << 10;

/// A thread's generator and what it may still give before its next seed.
struct Drawer {
    rng: ChaCha12Rng,
    left: usize,
}

impl Drawer {
    fn seeded() -> Drawer {
        Drawer {
            rng: ChaCha12Rng::from_seed(bytes::<32>()),
            left: RESEED_AFTER,
        }
    }

    fn fill(&mut self, out: &mut [u8]) {
        if self.left < out.len() {
            *self = Drawer::seeded();
        }
        self.left = self.left.saturating_sub(out.len());
        self.rng.fill_bytes(out);
    }
}

thread_local! {
    static DRAWER: RefCell<Option<Drawer>> = const { RefCell::new(None) };
}

/// `N` random bytes from this thread's generator (see the module's
/// comment).
fn drawn<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    DRAWER.with_borrow_mut(|d| d.get_or_insert_with(Drawer::seeded).fill(&mut b));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_draws_distinct_ids_across_its_reseeds() {
        // Four times the bytes between two seeds.
        let n = 4 * RESEED_AFTER / 16;
        let ids: std::collections::HashSet<String> = (0..n).map(|_| long_id()).collect();
        assert_eq!(ids.len(), n);
        assert!(ids
            .iter()
            .all(|id| id.len() == 32 && id.bytes().all(|c| c.is_ascii_hexdigit())));
    }

    #[test]
    fn a_generator_is_seeded_again_once_it_has_given_its_share() {
        let mut d = Drawer::seeded();
        let mut first = [0u8; 16];
        d.fill(&mut first);
        assert_eq!(d.left, RESEED_AFTER - 16);
        d.left = 8;
        let mut old_stream = d.rng.clone();
        let (mut b, mut c) = ([0u8; 16], [0u8; 16]);
        d.fill(&mut b);
        old_stream.fill_bytes(&mut c);
        assert_ne!(b, c, "drawn from a new seed, not the old stream");
        assert_eq!(d.left, RESEED_AFTER - 16, "its share counted from the new seed");
    }

    #[test]
    fn threads_draw_from_generators_seeded_apart() {
        let here: Vec<String> = (0..64).map(|_| long_id()).collect();
        let there: Vec<String> = std::thread::spawn(|| (0..64).map(|_| long_id()).collect())
            .join()
            .unwrap();
        assert!(here.iter().all(|id| !there.contains(id)));
    }

    #[test]
    fn an_index_is_below_its_bound_and_reaches_every_value() {
        let mut seen = [false; 3];
        for _ in 0..300 {
            let i = index(3);
            assert!(i < 3);
            seen[i] = true;
        }
        assert_eq!(seen, [true; 3]);
        assert_eq!(index(0), 0);
    }
}

//! Whether the desired state the agent holds is the one the control plane
//! meant: each answer names the digest of the state the node is to hold
//! once it took it ([`DesiredState::digest`](otherix_proto::agent::DesiredState::digest)),
//! and the agent compares it with its own of what it built.
//!
//! A state that checks out is taken with deltas for as long as they keep
//! it so: no whole state every few minutes "just in case" (at 1,000 nodes
//! each is 17 MiB the control plane serializes). A delta that does not is
//! not taken, and the whole state is asked for — unless the last whole
//! state did not check out either: then it is the digest that differs (a
//! control plane computing it another way), not the state, and asking for
//! the whole state at every answer would only load the control plane; the
//! agent falls back to the whole state every
//! [`WHOLE_STATE_EVERY`](otherix_proto::agent::WHOLE_STATE_EVERY), as with
//! a control plane that names no digest.

/// What the last answers showed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Verification {
    /// The state held is the one the answer that made it named.
    pub verified: bool,
    /// The last whole state's digest was ours.
    pub trusted: bool,
}

/// What to do with a state built from an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Take it; `verified` says whether it checked out.
    Take,
    /// Do not take it: ask for the whole state.
    AskWhole,
}

impl Verification {
    /// Notes a state built from a `whole` state or a delta, the digest its
    /// answer `named` (none from a control plane that predates it) and
    /// `ours` of the state built.
    pub fn check(&mut self, whole: bool, named: Option<u64>, ours: u64) -> Verdict {
        let Some(named) = named else {
            self.verified = false;
            return Verdict::Take;
        };
        let same = named == ours;
        if whole {
            self.trusted = same;
        } else if !same && self.trusted {
            self.verified = false;
            return Verdict::AskWhole;
        }
        self.verified = same;
        Verdict::Take
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_state_that_checks_out_makes_deltas_that_do_too_verified() {
        let mut v = Verification::default();
        assert_eq!(v.check(true, Some(7), 7), Verdict::Take);
        assert_eq!(
            v,
            Verification {
                verified: true,
                trusted: true
            }
        );
        assert_eq!(v.check(false, Some(8), 8), Verdict::Take);
        assert!(v.verified);
    }

    #[test]
    fn a_delta_that_does_not_check_out_is_refused_and_the_whole_state_asked_for() {
        let mut v = Verification::default();
        v.check(true, Some(7), 7);
        assert_eq!(v.check(false, Some(8), 9), Verdict::AskWhole);
        assert!(!v.verified, "the state held is not known good any more");
        assert!(v.trusted, "the digest itself is still trusted");
    }

    #[test]
    fn a_whole_state_that_does_not_check_out_turns_delta_checks_into_no_verdict() {
        let mut v = Verification::default();
        assert_eq!(
            v.check(true, Some(7), 6),
            Verdict::Take,
            "a whole state is taken anyway"
        );
        assert_eq!(
            v,
            Verification {
                verified: false,
                trusted: false
            }
        );
        // Deltas differ too: taken, never a whole state at every answer.
        assert_eq!(v.check(false, Some(8), 5), Verdict::Take);
        assert!(!v.verified);
        // One that matches after all verifies the state held.
        assert_eq!(v.check(false, Some(9), 9), Verdict::Take);
        assert!(v.verified);
    }

    #[test]
    fn an_answer_without_a_digest_leaves_the_state_unverified() {
        let mut v = Verification::default();
        v.check(true, Some(7), 7);
        assert_eq!(v.check(false, None, 1), Verdict::Take);
        assert!(!v.verified);
        assert_eq!(v.check(true, None, 1), Verdict::Take);
        assert!(!v.verified);
    }
}

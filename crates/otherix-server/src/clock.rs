//! This control plane's clock against the database's, on PostgreSQL.
//!
//! A revocation's instant is stamped by the replica that writes it and
//! compared with credentials' `iat`, stamped by whichever replica minted
//! them. So that a replica whose clock runs behind cannot mint a credential
//! that looks older than a revocation it was issued after, every replica
//! measures its clock against the database's (every registry round, a
//! query's midpoint against `clock_timestamp()`) and mints only while it is
//! within [`MAX_OFFSET`] of it: any two minting replicas then agree within
//! [`REPLICA_SKEW`], which [`crate::revoke`] covers. On SQLite there is one
//! control plane and its clock is the store's: nothing to compare.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

/// The most a replica's clock may be off the database's and still mint.
pub const MAX_OFFSET: Duration = Duration::from_millis(500);
/// The most two minting replicas' clocks can differ.
pub const REPLICA_SKEW: Duration = Duration::from_millis(2 * MAX_OFFSET.as_millis() as u64);
/// A reading whose query took longer than this says too little (its
/// midpoint may be off by half of it) and is not taken.
const MAX_ROUND_TRIP: Duration = Duration::from_millis(200);
/// A reading older than this no longer vouches for the clock: a clock can
/// be stepped at any time, and the registry reads every 2 s.
const STALE_AFTER: Duration = Duration::from_secs(10);

/// Why this replica may not mint.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Skewed {
    #[error("this control plane's clock is {0} ms off the database's (at most {max} ms may be); fix its time sync (NTP)", max = MAX_OFFSET.as_millis())]
    Off(i64),
    #[error("this control plane has not compared its clock with the database's lately")]
    Unmeasured,
}

/// The offset of the database's clock from ours, in milliseconds, from a
/// query sent at `sent` and answered at `answered` (ours) that read `db`;
/// `None` when the round trip was too slow to say.
pub fn offset_ms(sent: OffsetDateTime, db: OffsetDateTime, answered: OffsetDateTime) -> Option<i64> {
    let round_trip = answered - sent;
    if round_trip.is_negative() || round_trip > MAX_ROUND_TRIP {
        return None;
    }
    let midpoint: OffsetDateTime = sent + round_trip / 2;
    Some(i64::try_from((db - midpoint).whole_milliseconds()).unwrap_or(i64::MAX))
}

/// Whether a replica whose last reading was `reading` (offset, and how
/// long ago) may mint.
pub fn verdict(reading: Option<(i64, Duration)>) -> Result<(), Skewed> {
    match reading {
        None => Err(Skewed::Unmeasured),
        Some((_, age)) if age > STALE_AFTER => Err(Skewed::Unmeasured),
        Some((off, _)) if off.unsigned_abs() > MAX_OFFSET.as_millis() as u64 => Err(Skewed::Off(off)),
        Some(_) => Ok(()),
    }
}

/// The last reading, shared by the registry (which takes it) and the
/// broker (which checks it).
#[derive(Debug)]
pub struct ClockCheck {
    /// `false` on SQLite: always fine.
    compared: bool,
    last: Mutex<Option<(i64, Instant)>>,
}

impl ClockCheck {
    /// A check for a store of this dialect.
    pub fn new(dialect: otherix_store::Dialect) -> ClockCheck {
        ClockCheck {
            compared: dialect == otherix_store::Dialect::Postgres,
            last: Mutex::new(None),
        }
    }

    /// Reads the database's clock once and records the offset.
    pub async fn measure(&self, store: &otherix_store::Store) -> Result<(), otherix_store::StoreError> {
        let sent = OffsetDateTime::now_utc();
        let Some(db) = store.database_time().await? else {
            return Ok(());
        };
        let answered = OffsetDateTime::now_utc();
        if let Some(off) = offset_ms(sent, db, answered) {
            metrics::gauge!("otherix_clock_offset_seconds").set(off as f64 / 1000.0);
            let was = self
                .last
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .replace((off, Instant::now()));
            let bad = |o: i64| o.unsigned_abs() > MAX_OFFSET.as_millis() as u64;
            if bad(off) && was.is_none_or(|(o, _)| !bad(o)) {
                tracing::error!(
                    offset_ms = off,
                    "this control plane's clock is off the database's by more than {} ms: it brokers nothing until its time sync is fixed",
                    MAX_OFFSET.as_millis()
                );
            }
        }
        Ok(())
    }

    /// Whether this replica may mint now.
    pub fn check(&self) -> Result<(), Skewed> {
        if !self.compared {
            return Ok(());
        }
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        verdict(last.map(|(off, at)| (off, at.elapsed())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> OffsetDateTime {
        OffsetDateTime::UNIX_EPOCH + time::Duration::milliseconds(1_700_000_000_000 + ms)
    }

    #[test]
    fn the_offset_is_taken_against_the_querys_midpoint() {
        assert_eq!(offset_ms(at(0), at(50), at(100)), Some(0));
        assert_eq!(offset_ms(at(0), at(750), at(100)), Some(700));
        assert_eq!(offset_ms(at(0), at(-650), at(100)), Some(-700));
    }

    #[test]
    fn a_slow_or_backwards_reading_says_nothing() {
        assert_eq!(offset_ms(at(0), at(150), at(300)), None);
        assert_eq!(offset_ms(at(100), at(50), at(0)), None);
    }

    #[test]
    fn a_replica_mints_only_within_the_offset_and_while_the_reading_is_fresh() {
        let fresh = Duration::from_secs(1);
        assert_eq!(verdict(Some((0, fresh))), Ok(()));
        assert_eq!(verdict(Some((500, fresh))), Ok(()));
        assert_eq!(verdict(Some((-500, fresh))), Ok(()));
        assert_eq!(verdict(Some((501, fresh))), Err(Skewed::Off(501)));
        assert_eq!(verdict(Some((-2_000, fresh))), Err(Skewed::Off(-2_000)));
        assert_eq!(
            verdict(Some((0, Duration::from_secs(11)))),
            Err(Skewed::Unmeasured)
        );
        assert_eq!(verdict(None), Err(Skewed::Unmeasured));
    }

    #[test]
    fn on_sqlite_there_is_nothing_to_compare() {
        assert_eq!(ClockCheck::new(otherix_store::Dialect::Sqlite).check(), Ok(()));
        assert_eq!(
            ClockCheck::new(otherix_store::Dialect::Postgres).check(),
            Err(Skewed::Unmeasured)
        );
    }
}

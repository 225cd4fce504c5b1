//! Single use of credentials across restarts: the core [`ReplayCache`] in
//! memory, plus an optional append-only file of `<exp> <jti>` lines that is
//! reloaded (unexpired lines only) and compacted at start, so restarting a
//! gateway does not reopen a replay window for credentials still alive.
//!
//! Lines are appended with one `write` each and no `fsync`: a killed or
//! restarted process loses nothing (the page cache keeps it), a power loss
//! may lose the newest lines — the same trade as the store's
//! `synchronous=NORMAL`. The file is compacted again whenever it holds more
//! than twice the live entries (plus some slack), so its size stays
//! proportional to the credentials alive, at amortised constant cost.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use otherix_core::credential::{Refusal, ReplayCache, CLOCK_SKEW};
use time::OffsetDateTime;

use super::refused::Refused;

/// Slack before the file is compacted again, in lines.
const COMPACT_SLACK: usize = 1024;
/// Longest `jti` accepted (a 128-bit id is 32 hex digits).
const MAX_JTI: usize = 128;

pub(crate) struct ReplayGuard {
    cache: ReplayCache,
    log: Option<ReplayLog>,
}

struct ReplayLog {
    path: PathBuf,
    file: File,
    lines: usize,
}

impl ReplayGuard {
    /// Credentials remembered now.
    pub(crate) fn len(&self) -> usize {
        self.cache.len()
    }

    /// A guard remembering at most `capacity` credentials, reloading the
    /// unexpired entries of `path` (if any) and compacting it.
    pub(crate) fn open(capacity: usize, path: Option<&Path>, now: OffsetDateTime) -> io::Result<ReplayGuard> {
        let mut cache = ReplayCache::new(capacity);
        let Some(path) = path else {
            return Ok(ReplayGuard { cache, log: None });
        };
        let entries = load(path, now)?;
        let mut dropped = 0usize;
        for (jti, exp) in &entries {
            match cache.check_and_insert(jti, *exp, now) {
                Ok(()) | Err(Refusal::Replayed) => {}
                Err(_) => dropped += 1,
            }
        }
        if dropped > 0 {
            tracing::error!(
                dropped,
                capacity,
                file = %path.display(),
                "the replay file holds more live credentials than replay_capacity; \
                 those that did not fit may be replayed until they expire: raise replay_capacity"
            );
        }
        let file = rewrite(path, &entries)?;
        tracing::info!(live = entries.len(), file = %path.display(), "replay cache reloaded");
        Ok(ReplayGuard {
            cache,
            log: Some(ReplayLog {
                path: path.to_path_buf(),
                file,
                lines: entries.len(),
            }),
        })
    }

    /// Records `jti` as used (in memory, then in the file); refuses a
    /// credential used before. A failure to write the file refuses too: a
    /// used credential that a restart could forget is a replay window.
    #[cfg(test)]
    pub(crate) fn check_and_insert(
        &mut self,
        jti: &str,
        exp: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(), Refused> {
        self.check_and_insert_for(jti, None, exp, now)
    }

    /// [`ReplayGuard::check_and_insert`], counting the entry against
    /// `owner`'s share (principal, most live entries) when one is given.
    pub(crate) fn check_and_insert_for(
        &mut self,
        jti: &str,
        owner: Option<(&str, usize)>,
        exp: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(), Refused> {
        if jti.is_empty()
            || jti.len() > MAX_JTI
            || !jti
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(Refusal::Malformed("jti is not a plain id".into()).into());
        }
        match owner {
            Some((owner, share)) => self.cache.check_and_insert_owned(jti, owner, share, exp, now)?,
            None => self.cache.check_and_insert(jti, exp, now)?,
        }
        let Some(log) = &mut self.log else {
            return Ok(());
        };
        let line = format!("{} {jti}\n", ceil_unix(exp));
        if let Err(e) = log.file.write_all(line.as_bytes()) {
            tracing::error!(error = %e, file = %log.path.display(), "cannot append to the replay file");
            return Err(Refused::ReplayLog);
        }
        log.lines += 1;
        if log.lines > 2 * self.cache.len() + COMPACT_SLACK {
            if let Err(e) = log.compact(now) {
                tracing::warn!(error = %e, file = %log.path.display(), "cannot compact the replay file");
            }
        }
        Ok(())
    }
}

impl ReplayLog {
    fn compact(&mut self, now: OffsetDateTime) -> io::Result<()> {
        let entries = load(&self.path, now)?;
        self.file = rewrite(&self.path, &entries)?;
        self.lines = entries.len();
        Ok(())
    }
}

/// The entries of `path` whose credential can still pass the time check.
/// A missing file is empty; unreadable lines (a torn last write) are skipped.
fn load(path: &Path, now: OffsetDateTime) -> io::Result<Vec<(String, OffsetDateTime)>> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let text = String::from_utf8_lossy(&bytes);
    Ok(text
        .lines()
        .filter_map(|line| {
            let (secs, jti) = line.split_once(' ')?;
            let exp = OffsetDateTime::from_unix_timestamp(secs.parse().ok()?).ok()?;
            let plain = !jti.is_empty() && jti.len() <= MAX_JTI && jti.bytes().all(|b| b.is_ascii_graphic());
            (plain && exp + CLOCK_SKEW >= now).then(|| (jti.to_string(), exp))
        })
        .collect())
}

/// Replaces `path` with `entries` (write, fsync, rename) and returns it
/// opened for appending.
fn rewrite(path: &Path, entries: &[(String, OffsetDateTime)]) -> io::Result<File> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    {
        let mut out = io::BufWriter::new(
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?,
        );
        for (jti, exp) in entries {
            writeln!(out, "{} {jti}", ceil_unix(*exp))?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    OpenOptions::new().append(true).mode(0o600).open(path)
}

/// Whole seconds, rounded up: a reloaded entry must not be forgotten before
/// its credential stops passing the time check.
fn ceil_unix(t: OffsetDateTime) -> i64 {
    let secs = t.unix_timestamp();
    if t.nanosecond() > 0 {
        secs + 1
    } else {
        secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::Duration;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn temp_file(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("otherix-gw-replay-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir.join("replay.log")
    }

    #[test]
    fn used_credentials_survive_a_reopen_and_expired_ones_are_compacted_away() {
        let path = temp_file("reopen");
        let live = now() + Duration::seconds(300);
        let dead = now() - Duration::seconds(100);
        {
            let mut g = ReplayGuard::open(10, Some(&path), now()).unwrap();
            g.check_and_insert("aaaa", live, now()).unwrap();
            g.check_and_insert("bbbb", dead + Duration::seconds(200), now())
                .unwrap();
        }
        // Later, "bbbb" has expired (plus skew) and "aaaa" has not.
        let later = now() + Duration::seconds(150);
        let mut g = ReplayGuard::open(10, Some(&path), later).unwrap();
        assert!(matches!(
            g.check_and_insert("aaaa", live, later),
            Err(Refused::Credential(Refusal::Replayed))
        ));
        let text = fs::read_to_string(&path).unwrap();
        assert!(!text.contains("bbbb"), "compacted at start: {text}");
        assert_eq!(
            text.lines().count(),
            1,
            "aaaa kept, its refused second use not appended: {text}"
        );
        let _ = fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let path = temp_file("torn");
        let exp = ceil_unix(now() + Duration::seconds(300));
        fs::write(&path, format!("{exp} good\n{exp}")).unwrap();
        let mut g = ReplayGuard::open(10, Some(&path), now()).unwrap();
        assert!(g.check_and_insert("good", now(), now()).is_err());
        let _ = fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn the_file_is_compacted_when_it_outgrows_the_live_entries() {
        let path = temp_file("grow");
        let mut g = ReplayGuard::open(100_000, Some(&path), now()).unwrap();
        // Each credential expires right away: the live set stays tiny.
        for i in 0..3000 {
            let t = now() + Duration::seconds(i);
            g.check_and_insert(
                &format!("j{i}"),
                t - CLOCK_SKEW - Duration::seconds(1),
                t - Duration::seconds(2),
            )
            .unwrap();
        }
        let lines = fs::read_to_string(&path).unwrap().lines().count();
        assert!(lines <= 2 * COMPACT_SLACK, "{lines} lines");
        let _ = fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn a_jti_that_could_break_the_file_format_is_refused() {
        let mut g = ReplayGuard::open(10, None, now()).unwrap();
        for bad in ["", "a b", "a\nb", &"a".repeat(200)] {
            assert!(matches!(
                g.check_and_insert(bad, now(), now()),
                Err(Refused::Credential(Refusal::Malformed(_)))
            ));
        }
    }
}

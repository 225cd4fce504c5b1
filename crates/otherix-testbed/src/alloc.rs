//! Picking a world's prefix and /24 safely across processes, and cleaning stale worlds.
//!
//! Everything here runs under an exclusive `flock` on `STATE_DIR/lock`: stale worlds are
//! cleaned, a free prefix and /24 are chosen, and the world's record is written before
//! the lock is released, so a parallel process sees the claim.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{sys, Error, Result, FABRIC_RANGE, STATE_DIR};

/// The first two octets of [`FABRIC_RANGE`].
pub(crate) const RANGE_OCTETS: [u8; 2] = [10, 213];

/// The /24s a world may take: `10.213.N.0/24` for N in this range.
const SUBNETS: std::ops::RangeInclusive<u8> = 1..=254;

/// What a world writes to `STATE_DIR/P.world`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Record {
    pub prefix: String,
    pub pid: u32,
    /// Start time of `pid`, so that a reused pid is not mistaken for the owner.
    pub pid_start: u64,
    /// N of `10.213.N.0/24`.
    pub subnet: u8,
    pub hint: String,
    pub dir: PathBuf,
}

impl Record {
    pub fn path(prefix: &str) -> PathBuf {
        Path::new(STATE_DIR).join(format!("{prefix}.world"))
    }

    fn to_text(&self) -> String {
        format!(
            "prefix={}\npid={}\npid_start={}\nsubnet={}.{}.{}.0/24\nhint={}\ndir={}\n",
            self.prefix,
            self.pid,
            self.pid_start,
            RANGE_OCTETS[0],
            RANGE_OCTETS[1],
            self.subnet,
            self.hint.replace('\n', " "),
            self.dir.display()
        )
    }

    fn parse(text: &str) -> Option<Record> {
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
                .map(str::to_owned)
        };
        let subnet = field("subnet")?;
        let subnet = subnet.strip_prefix(&format!("{}.{}.", RANGE_OCTETS[0], RANGE_OCTETS[1]))?;
        Some(Record {
            prefix: field("prefix").filter(|p| is_prefix(p))?,
            pid: field("pid")?.parse().ok()?,
            pid_start: field("pid_start")?.parse().ok()?,
            subnet: subnet.strip_suffix(".0/24")?.parse().ok()?,
            hint: field("hint").unwrap_or_default(),
            dir: field("dir")?.into(),
        })
    }

    /// Whether the process that made this world is still running.
    fn owner_alive(&self) -> bool {
        sys::process_start_time(self.pid) == Some(self.pid_start)
    }
}

/// Whether `s` has the shape of a world prefix: `ox` + 4 lowercase hex digits.
pub(crate) fn is_prefix(s: &str) -> bool {
    s.len() == 6
        && s.starts_with("ox")
        && s[2..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Holds the allocation lock until dropped.
struct Lock(#[allow(dead_code)] File);

fn lock() -> Result<Lock> {
    std::fs::create_dir_all(STATE_DIR).map_err(Error::io(format!("could not create {STATE_DIR}")))?;
    let path = Path::new(STATE_DIR).join("lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(Error::io(format!("could not open {}", path.display())))?;
    file.lock()
        .map_err(Error::io(format!("could not lock {}", path.display())))?;
    Ok(Lock(file))
}

/// Cleans stale worlds, then claims a prefix and a /24 for a new world: writes its record
/// and creates its directory under `log_root`.
pub(crate) fn claim(hint: &str, log_root: &Path) -> Result<Record> {
    let _lock = lock()?;
    let live = clean_stale_worlds();

    let routes = sys::ip(&["-4", "route", "show", "table", "all"])?;
    let routes = parse_routes(&routes);
    let taken: HashSet<u8> = live.iter().map(|r| r.subnet).collect();
    let subnet = pick_subnet(&routes, &taken)?;

    let names: Vec<String> = sys::netns_names().into_iter().chain(sys::host_links()).collect();
    let prefix = (0..1000)
        .map(|_| random_prefix())
        .find(|p| {
            !names.iter().any(|n| n.starts_with(p.as_str()))
                && !Record::path(p).exists()
                && !log_root.join(p).exists()
        })
        .ok_or_else(|| Error::RangeUnavailable {
            range: FABRIC_RANGE,
            reason: "could not find an unused world prefix".to_owned(),
        })?;

    let dir = log_root.join(&prefix);
    std::fs::create_dir_all(&dir).map_err(Error::io(format!("could not create {}", dir.display())))?;
    let pid = std::process::id();
    let record = Record {
        prefix,
        pid,
        // This process is running, so its stat is readable; 0 would only make it look stale.
        pid_start: sys::process_start_time(pid).unwrap_or(0),
        subnet,
        hint: hint.to_owned(),
        dir,
    };
    let path = Record::path(&record.prefix);
    std::fs::write(&path, record.to_text())
        .map_err(Error::io(format!("could not write {}", path.display())))?;
    Ok(record)
}

/// Tears down every world whose owner is gone; returns the records of the live ones.
/// Must run under the lock.
fn clean_stale_worlds() -> Vec<Record> {
    let Ok(entries) = std::fs::read_dir(STATE_DIR) else {
        return Vec::new();
    };
    let mut live = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(prefix) = path.file_name().and_then(|n| n.to_str()?.strip_suffix(".world")) else {
            continue;
        };
        if !is_prefix(prefix) {
            continue;
        }
        let record = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| Record::parse(&t));
        match record {
            Some(record) if record.owner_alive() => live.push(record),
            // Records are written under the lock we hold, so one that cannot be read was
            // left by a process that died while writing it: stale as well.
            record => {
                let owner = record
                    .as_ref()
                    .map_or("unknown".to_owned(), |r| r.pid.to_string());
                let left = sys::teardown(prefix);
                // Only a directory named after the world is its directory.
                if let Some(record) = record.as_ref().filter(|r| r.dir.ends_with(prefix)) {
                    let _ = std::fs::remove_dir_all(&record.dir);
                }
                let _ = std::fs::remove_file(&path);
                eprintln!("otherix-testbed: cleaned up stale world {prefix} (owner pid {owner} is gone)");
                if !left.is_empty() {
                    eprintln!(
                        "otherix-testbed: stale world {prefix} left behind: {}",
                        left.join(", ")
                    );
                }
            }
        }
    }
    live
}

/// `ox` + 4 random hex digits, from std's randomly keyed hasher.
fn random_prefix() -> String {
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("ox{:04x}", hasher.finish() & 0xffff)
}

/// An IPv4 route destination: address and prefix length.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Dest {
    addr: Ipv4Addr,
    len: u8,
}

impl Dest {
    fn overlaps(self, other: Dest) -> bool {
        let len = self.len.min(other.len);
        let mask = if len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(len))
        };
        u32::from(self.addr) & mask == u32::from(other.addr) & mask
    }
}

/// Destinations of `ip -4 route show table all`, with each line for messages. Default
/// routes are left out: every address "has" one, and a world never uses it.
fn parse_routes(out: &str) -> Vec<(Dest, String)> {
    const TYPES: &[&str] = &[
        "unicast",
        "local",
        "broadcast",
        "multicast",
        "throw",
        "unreachable",
        "prohibit",
        "blackhole",
        "nat",
        "anycast",
    ];
    out.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let mut dest = words.next()?;
            if TYPES.contains(&dest) {
                dest = words.next()?;
            }
            if dest == "default" {
                return None;
            }
            let (addr, len) = dest.split_once('/').unwrap_or((dest, "32"));
            let dest = Dest {
                addr: addr.parse().ok()?,
                len: len.parse().ok().filter(|&l| l <= 32)?,
            };
            (dest.len > 0).then(|| (dest, line.trim().to_owned()))
        })
        .collect()
}

/// The first /24 of the range that no live world holds and no host route reaches.
fn pick_subnet(routes: &[(Dest, String)], taken: &HashSet<u8>) -> Result<u8> {
    let range = Dest {
        addr: Ipv4Addr::new(RANGE_OCTETS[0], RANGE_OCTETS[1], 0, 0),
        len: 16,
    };
    let free = SUBNETS.filter(|n| !taken.contains(n)).find(|&n| {
        let candidate = Dest {
            addr: Ipv4Addr::new(RANGE_OCTETS[0], RANGE_OCTETS[1], n, 0),
            len: 24,
        };
        !routes.iter().any(|(dest, _)| dest.overlaps(candidate))
    });
    free.ok_or_else(|| {
        let covering = routes
            .iter()
            .find(|(dest, _)| dest.len <= 16 && dest.overlaps(range));
        let reason = match covering {
            Some((_, line)) => format!(
                "the host already routes the whole range (`{line}`)\n\
                 hint: the testbed sends no traffic where the host routes; remove that route or \
                 run the tests on another machine"
            ),
            None => format!(
                "every /24 is held by a live world or reached by a host route ({} live worlds)",
                taken.len()
            ),
        };
        Error::RangeUnavailable {
            range: FABRIC_RANGE,
            reason,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTES: &str = "default via 192.0.2.1 dev eth0\n\
        192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2\n\
        10.213.1.0/24 dev oxa3f1h proto kernel scope link src 10.213.1.1\n\
        local 10.213.2.7 dev lo table local proto kernel scope host src 10.213.2.7\n\
        broadcast 127.255.255.255 dev lo table local proto kernel scope link src 127.0.0.1\n\
        unreachable 10.213.3.128/25\n";

    #[test]
    fn records_round_trip() {
        let record = Record {
            prefix: "oxa3f1".into(),
            pid: 42,
            pid_start: 1234,
            subnet: 7,
            hint: "a test".into(),
            dir: "/tmp/otherix-testbed/oxa3f1".into(),
        };
        assert_eq!(Record::parse(&record.to_text()), Some(record));
    }

    #[test]
    fn truncated_record_does_not_parse() {
        assert_eq!(Record::parse("prefix=oxa3f1\npid=42\n"), None);
    }

    #[test]
    fn prefixes_are_ox_and_four_hex_digits() {
        assert!(is_prefix("oxa3f1"));
        assert!(!is_prefix("oxa3f"));
        assert!(!is_prefix("oxA3F1"));
        assert!(!is_prefix("xxa3f1"));
        for _ in 0..100 {
            assert!(is_prefix(&random_prefix()));
        }
    }

    #[test]
    fn subnets_reached_by_any_host_route_are_skipped() {
        let routes = parse_routes(ROUTES);
        assert_eq!(pick_subnet(&routes, &HashSet::new()).unwrap(), 4);
    }

    #[test]
    fn subnets_of_live_worlds_are_skipped() {
        let taken = HashSet::from([1, 2, 4]);
        assert_eq!(pick_subnet(&[], &taken).unwrap(), 3);
    }

    #[test]
    fn a_route_covering_the_range_is_named_in_the_error() {
        let routes = parse_routes("default via 192.0.2.1 dev eth0\n10.0.0.0/8 via 192.0.2.9 dev eth0\n");
        let err = pick_subnet(&routes, &HashSet::new()).unwrap_err().to_string();
        assert!(err.contains("10.0.0.0/8 via 192.0.2.9"), "{err}");
    }

    #[test]
    fn the_default_route_does_not_count() {
        assert!(parse_routes("default via 192.0.2.1 dev eth0\n").is_empty());
    }
}

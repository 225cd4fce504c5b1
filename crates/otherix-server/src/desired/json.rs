//! A section's entries as JSON, written once and copied into every
//! member's answer.
//!
//! At 1,000 nodes an overlay's section holds thousands of entries and
//! about a thousand members take each of them: a whole state at a node's
//! start, the entries a create added at the members' next heartbeats. A
//! member's view is the section less its own few entries (those at its
//! VTEP, its own lease's neighbor), so the entries' JSON is the same for
//! all of them but those few. [`ListJson`] keeps a list's entries written
//! as serde writes them, joined by commas, with where each one ends: a
//! member's view is copied in a few pieces, not formatted entry by entry.
//! A section's JSON follows its revisions ([`SectionJson::updated`]):
//! entries kept are copied, only the added ones are written.

use std::net::Ipv4Addr;

use otherix_core::MacAddr;
use otherix_proto::agent::{FdbEntry, NeighborEntry};

use super::{keep_fdb, open_field, write_fdb, write_neighbor, Section, SectionDiff};

/// A sorted list's entries as JSON (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListJson {
    /// The entries, each as serde writes it, with a comma between two.
    bytes: Vec<u8>,
    /// Where each entry ends in `bytes` (the next begins one past it).
    ends: Vec<u32>,
}

impl ListJson {
    /// `list`'s entries, each written with `write`.
    pub fn of<T>(list: &[T], write: fn(&mut Vec<u8>, &T)) -> ListJson {
        let mut j = ListJson {
            bytes: Vec::with_capacity(list.len() * 48),
            ends: Vec::with_capacity(list.len()),
        };
        for e in list {
            j.push(e, write);
        }
        j
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn push<T>(&mut self, e: &T, write: fn(&mut Vec<u8>, &T)) {
        if !self.ends.is_empty() {
            self.bytes.push(b',');
        }
        write(&mut self.bytes, e);
        self.ends.push(offset(self.bytes.len()));
    }

    /// Where entry `i` begins.
    fn start(&self, i: usize) -> usize {
        match i {
            0 => 0,
            i => self.ends[i - 1] as usize + 1,
        }
    }

    /// Entry `i`'s bytes.
    fn entry(&self, i: usize) -> &[u8] {
        &self.bytes[self.start(i)..self.ends[i] as usize]
    }

    /// The bytes of entries `lo..hi`, commas between.
    fn run(&self, lo: usize, hi: usize) -> &[u8] {
        &self.bytes[self.start(lo)..self.ends[hi - 1] as usize]
    }

    /// Appends `other`'s entries `lo..hi` in one copy.
    fn copy_run(&mut self, other: &ListJson, lo: usize, hi: usize) {
        if lo >= hi {
            return;
        }
        if !self.ends.is_empty() {
            self.bytes.push(b',');
        }
        let from = other.start(lo);
        let base = self.bytes.len();
        self.bytes.extend_from_slice(other.run(lo, hi));
        self.ends.extend(
            other.ends[lo..hi]
                .iter()
                .map(|&e| offset(e as usize - from + base)),
        );
    }

    /// The JSON of the list `old` (whose JSON this is) less `removed` plus
    /// `added` (each sorted, each once; `removed` in `old`, `added` not):
    /// the entries kept copied in runs, the added ones written. Costs a
    /// copy of the list's bytes, not the formatting of its entries.
    pub fn updated<T: Ord>(
        &self,
        old: &[T],
        added: &[T],
        removed: &[T],
        write: fn(&mut Vec<u8>, &T),
    ) -> ListJson {
        debug_assert_eq!(old.len(), self.len());
        let mut next = ListJson {
            bytes: Vec::with_capacity(self.bytes.len() + added.len() * 48),
            ends: Vec::with_capacity((old.len() + added.len()).saturating_sub(removed.len())),
        };
        let (mut a, mut r) = (0, 0);
        // The entries of `old` from `run` on are kept and not yet copied.
        let mut run = 0;
        for (i, e) in old.iter().enumerate() {
            let gone = removed.get(r).is_some_and(|x| x == e);
            let before = added.get(a).is_some_and(|x| x < e);
            if gone || before {
                next.copy_run(self, run, i);
                run = i;
            }
            while let Some(x) = added.get(a).filter(|x| *x < e) {
                next.push(x, write);
                a += 1;
            }
            if gone {
                r += 1;
                run = i + 1;
            }
        }
        next.copy_run(self, run, old.len());
        for x in &added[a..] {
            next.push(x, write);
        }
        next
    }

    /// Writes the entries but those at the indices `skip` (ascending),
    /// commas between; whether it wrote any.
    pub fn write_except(&self, out: &mut Vec<u8>, skip: &[usize]) -> bool {
        let mut any = false;
        let mut from = 0;
        for &s in skip.iter().chain(std::iter::once(&self.len())) {
            if s > from {
                if any {
                    out.push(b',');
                }
                out.extend_from_slice(self.run(from, s));
                any = true;
            }
            from = from.max(s + 1);
        }
        any
    }

    /// Writes `"key":[...]` after a comma with the entries but those at
    /// `skip`, nothing when none is left (serde's `skip_serializing_if`).
    pub fn write_field_except(&self, out: &mut Vec<u8>, key: &[u8], skip: &[usize]) {
        if self.len() <= skip.len() {
            return;
        }
        open_field(out, key);
        self.write_except(out, skip);
        out.push(b']');
    }
}

/// An offset into a list's JSON. A section's JSON is far below 4 GiB (tens
/// of MiB at 1,000 nodes).
fn offset(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A section's (or a diff's added) FDB and neighbor entries as JSON.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SectionJson {
    pub fdb: ListJson,
    pub neighbors: ListJson,
}

impl SectionJson {
    /// `s`'s entries.
    pub fn of(s: &Section) -> SectionJson {
        SectionJson::of_lists(&s.fdb, &s.neighbors)
    }

    /// The entries `diff` added.
    pub fn added(diff: &SectionDiff) -> SectionJson {
        SectionJson::of_lists(&diff.fdb_added, &diff.neighbors_added)
    }

    fn of_lists(fdb: &[FdbEntry], neighbors: &[NeighborEntry]) -> SectionJson {
        SectionJson {
            fdb: ListJson::of(fdb, write_fdb),
            neighbors: ListJson::of(neighbors, write_neighbor),
        }
    }

    /// The JSON of the section `old` (whose JSON this is) changed by `diff`.
    pub fn updated(&self, old: &Section, diff: &SectionDiff) -> SectionJson {
        SectionJson {
            fdb: self
                .fdb
                .updated(&old.fdb, &diff.fdb_added, &diff.fdb_removed, write_fdb),
            neighbors: self.neighbors.updated(
                &old.neighbors,
                &diff.neighbors_added,
                &diff.neighbors_removed,
                write_neighbor,
            ),
        }
    }
}

/// The indices of the FDB entries of `fdb` the member at `vtep` leaves out
/// (ascending): those at its own VTEP. A pass comparing addresses, not a
/// formatting of entries.
pub fn fdb_skips(fdb: &[FdbEntry], vtep: Option<Ipv4Addr>) -> Vec<usize> {
    match vtep {
        None => Vec::new(),
        Some(_) => fdb
            .iter()
            .enumerate()
            .filter(|(_, e)| !keep_fdb(e, vtep))
            .map(|(i, _)| i)
            .collect(),
    }
}

/// The index of the neighbor entry of sorted `neighbors` the member with
/// the lease `(ip, mac)` leaves out (its own), if there is one.
pub fn neighbor_skip(neighbors: &[NeighborEntry], lease: (Ipv4Addr, MacAddr)) -> Vec<usize> {
    let own = NeighborEntry {
        ip: lease.0,
        mac: lease.1,
    };
    match neighbors.binary_search(&own) {
        Ok(i) => vec![i],
        Err(_) => Vec::new(),
    }
}

/// Writes `"key":[...]` after a comma: the entries of the sorted lists
/// `lists` (each with its JSON) in order, each once, those `keep` keeps —
/// copied from their list's JSON. Nothing when none is kept. The entries
/// kept are sorted together (a member far behind takes a change of
/// hundreds of revisions, each of a few entries), not merged by a pick of
/// the least of the lists' heads for each entry.
pub fn write_merged<T: Ord>(
    out: &mut Vec<u8>,
    key: &[u8],
    lists: &[(&[T], &ListJson)],
    keep: impl Fn(&T) -> bool,
) {
    let mut kept: Vec<(&T, usize, usize)> = lists
        .iter()
        .enumerate()
        .flat_map(|(k, (list, _))| list.iter().enumerate().map(move |(i, e)| (e, k, i)))
        .filter(|(e, _, _)| keep(e))
        .collect();
    if kept.is_empty() {
        return;
    }
    if lists.len() > 1 {
        kept.sort_unstable_by(|a, b| a.0.cmp(b.0));
        kept.dedup_by(|a, b| a.0 == b.0);
    }
    open_field(out, key);
    for (n, (_, k, i)) in kept.into_iter().enumerate() {
        if n > 0 {
            out.push(b',');
        }
        out.extend_from_slice(lists[k].1.entry(i));
    }
    out.push(b']');
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn neighbor(ip: u8, mac: u8) -> NeighborEntry {
        NeighborEntry {
            ip: Ipv4Addr::new(10, 0, 0, ip),
            mac: MacAddr([2, 0, 0, 0, 0, mac]),
        }
    }

    fn fdb(mac: u8, vtep: u8) -> FdbEntry {
        FdbEntry {
            mac: MacAddr([2, 0, 0, 0, 0, mac]),
            vtep: Ipv4Addr::new(192, 168, 0, vtep),
        }
    }

    /// What `write_list` of the entries gives: serde's list, commas between.
    fn formatted<T>(list: &[T], write: fn(&mut Vec<u8>, &T)) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, e) in list.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write(&mut out, e);
        }
        out
    }

    fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
        v.sort_unstable();
        v.dedup();
        v
    }

    proptest! {
        /// A list's JSON followed through changes is the JSON of the list
        /// it became, byte for byte and entry by entry; a view of it less
        /// any entries is the formatting of the entries left.
        #[test]
        fn a_lists_json_follows_its_changes_and_views(
            start in proptest::collection::vec((0u8..40, 0u8..6), 0..40),
            steps in proptest::collection::vec(
                (proptest::collection::vec((0u8..40, 0u8..6), 0..8), proptest::collection::vec(any::<prop::sample::Index>(), 0..8)),
                0..12,
            ),
            skip in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let mut list = sorted(start.iter().map(|&(m, v)| fdb(m, v)).collect());
            let mut json = ListJson::of(&list, write_fdb);
            for (add, remove) in steps {
                let removed = if list.is_empty() {
                    Vec::new()
                } else {
                    sorted(remove.iter().map(|i| list[i.index(list.len())]).collect())
                };
                let added: Vec<FdbEntry> = sorted(
                    add.iter()
                        .map(|&(m, v)| fdb(m, v))
                        .filter(|e| list.binary_search(e).is_err())
                        .collect(),
                );
                json = json.updated(&list, &added, &removed, write_fdb);
                list.retain(|e| removed.binary_search(e).is_err());
                list.extend(added.iter().copied());
                list.sort_unstable();
                prop_assert_eq!(&json, &ListJson::of(&list, write_fdb));
                for (i, e) in list.iter().enumerate() {
                    let one = formatted(std::slice::from_ref(e), write_fdb);
                    prop_assert_eq!(json.entry(i), one.as_slice());
                }
            }
            let skip = if list.is_empty() {
                Vec::new()
            } else {
                sorted(skip.iter().map(|i| i.index(list.len())).collect())
            };
            let kept: Vec<FdbEntry> = list
                .iter()
                .enumerate()
                .filter(|(i, _)| skip.binary_search(i).is_err())
                .map(|(_, e)| *e)
                .collect();
            let mut out = Vec::new();
            prop_assert_eq!(json.write_except(&mut out, &skip), !kept.is_empty());
            prop_assert_eq!(out, formatted(&kept, write_fdb));
        }

        /// Lists merged write each entry once, in order, those kept only,
        /// as the formatting of their sorted union does.
        #[test]
        fn merged_lists_write_their_sorted_union(
            lists in proptest::collection::vec(proptest::collection::vec((0u8..30, 0u8..30), 0..10), 0..5),
            drop_ip in 0u8..30,
        ) {
            let lists: Vec<Vec<NeighborEntry>> = lists
                .into_iter()
                .map(|l| sorted(l.into_iter().map(|(i, m)| neighbor(i, m)).collect()))
                .collect();
            let jsons: Vec<ListJson> = lists.iter().map(|l| ListJson::of(l, write_neighbor)).collect();
            let pairs: Vec<(&[NeighborEntry], &ListJson)> =
                lists.iter().map(Vec::as_slice).zip(&jsons).collect();
            let keep = |e: &NeighborEntry| e.ip.octets()[3] != drop_ip;
            let mut out = Vec::new();
            write_merged(&mut out, b"neighbors_added", &pairs, keep);
            let union: Vec<NeighborEntry> =
                sorted(lists.iter().flatten().copied().filter(|e| keep(e)).collect());
            let mut want = Vec::new();
            super::super::write_list(&mut want, b"neighbors_added", &union, write_neighbor);
            prop_assert_eq!(out, want);
        }
    }

    #[test]
    fn a_members_own_entries_are_found_to_be_left_out() {
        let list = vec![fdb(1, 1), fdb(2, 2), fdb(3, 1), fdb(4, 3)];
        assert_eq!(fdb_skips(&list, Some(Ipv4Addr::new(192, 168, 0, 1))), vec![0, 2]);
        assert!(fdb_skips(&list, None).is_empty());
        let nbs = vec![neighbor(1, 1), neighbor(2, 2), neighbor(3, 3)];
        assert_eq!(
            neighbor_skip(&nbs, (Ipv4Addr::new(10, 0, 0, 2), MacAddr([2, 0, 0, 0, 0, 2]))),
            vec![1]
        );
        // The same address with another MAC is not the member's own.
        assert!(neighbor_skip(&nbs, (Ipv4Addr::new(10, 0, 0, 2), MacAddr([2, 0, 0, 0, 0, 9]))).is_empty());
    }
}

//! Copy buffers not in use, per thread. A splice direction and the client's
//! read-ahead take one only while they hold bytes and give it back as soon
//! as they are empty, so idle sessions hold none and busy ones keep reusing
//! warm buffers instead of allocating (and zeroing) one per read. A task's buffers are taken and
//! given back on whichever worker thread polls it.

use std::cell::RefCell;

/// Most spare buffers a thread keeps; more are freed. Only streams holding
/// unwritten bytes keep a buffer out, so a few cover a busy thread.
const KEEP: usize = 8;

thread_local! {
    static SPARE: RefCell<Vec<Box<[u8]>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `size` bytes: a spare one, or a new one. Spare buffers of
/// another size (another gateway's configuration) are freed on the way.
pub(crate) fn take(size: usize) -> Box<[u8]> {
    SPARE
        .try_with(|spare| {
            let mut spare = spare.borrow_mut();
            std::iter::from_fn(|| spare.pop()).find(|b| b.len() == size)
        })
        .ok()
        .flatten()
        .unwrap_or_else(|| vec![0; size].into_boxed_slice())
}

/// Keeps `buf` for the next [`take`] on this thread, or frees it.
pub(crate) fn give(buf: Box<[u8]>) {
    // During thread teardown the list is gone: the buffer is just freed.
    let _ = SPARE.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        if spare.len() < KEEP {
            spare.push(buf);
        }
    });
}

#[cfg(test)]
pub(crate) fn count() -> usize {
    SPARE.with(|spare| spare.borrow().len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spare_buffers_are_reused_and_other_sizes_are_not() {
        give(vec![7u8; 4096].into_boxed_slice());
        let again = take(4096);
        assert_eq!(
            (again.len(), again[0]),
            (4096, 7),
            "the spare buffer is handed out again"
        );
        give(again);
        let other = take(8192);
        assert_eq!(
            (other.len(), other[0]),
            (8192, 0),
            "a buffer of another size is fresh"
        );
    }

    #[test]
    fn a_thread_keeps_only_a_few_spares() {
        for _ in 0..KEEP + 5 {
            give(vec![0u8; 4096].into_boxed_slice());
        }
        assert_eq!(count(), KEEP);
    }
}

//! The shared board: a small file mapped into every contender's memory.
//!
//! Checking a lock with the lock's own state would only repeat its claims, so the
//! contenders keep an independent count: each increments `holders` right after its
//! acquire returns and decrements it right before it releases. Whoever finds the count
//! already above zero when adding itself has held at the same time as someone else: a
//! violation. Atomics in shared memory are coherent across processes, which no
//! backend round trip could be.
//!
//! Times are `CLOCK_MONOTONIC` nanoseconds: on Linux one clock for every process on
//! the machine (unlike `std::time::Instant`, which cannot be read as a number), and not
//! moved by NTP like the wall clock.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::MmapRaw;
use nix::time::{ClockId, clock_gettime};

/// Tells a board from any other file of the same size.
const MAGIC: u64 = 0x6c6f_636b_6265_6e63; // "lockbenc"
/// The mapped size: one page, far more than `Board` needs.
const SIZE: u64 = 4096;

/// What the contenders share. `repr(C)` with atomics only: every process sees the same
/// layout, and all-zero bytes (a fresh file) are a valid, empty board.
#[repr(C)]
pub struct Board {
    magic: AtomicU64,
    /// Contenders connected and warmed up, waiting for the start.
    pub ready: AtomicU32,
    /// Contenders inside the critical section right now.
    pub holders: AtomicU32,
    /// The measured window, set by the parent once every contender is ready (start
    /// is written last: a contender that sees it also sees the end).
    pub start_ns: AtomicU64,
    pub end_ns: AtomicU64,
    /// Times a contender entered while another was inside.
    pub violations: AtomicU64,
    /// The most contenders ever seen inside at once.
    pub most_holders: AtomicU32,
}

/// A mapping of a board file; the board lives as long as the mapping.
pub struct SharedBoard {
    map: MmapRaw,
}

impl SharedBoard {
    /// Creates the file at `path` (it must not exist) with an empty board.
    pub fn create(path: &Path) -> io::Result<SharedBoard> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        file.set_len(SIZE)?;
        let board = SharedBoard::map(&file)?;
        board
            .board_unchecked()
            .magic
            .store(MAGIC, std::sync::atomic::Ordering::SeqCst);
        Ok(board)
    }

    /// Maps the board another process created at `path`.
    pub fn open(path: &Path) -> io::Result<SharedBoard> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() < SIZE {
            return Err(io::Error::other("not a lockbench board: too short"));
        }
        let board = SharedBoard::map(&file)?;
        if board
            .board()
            .magic
            .load(std::sync::atomic::Ordering::SeqCst)
            != MAGIC
        {
            return Err(io::Error::other("not a lockbench board: no magic number"));
        }
        Ok(board)
    }

    fn map(file: &File) -> io::Result<SharedBoard> {
        let map = MmapRaw::map_raw(file)?;
        if (map.len() as u64) < SIZE {
            return Err(io::Error::other("board mapping too short"));
        }
        Ok(SharedBoard { map })
    }

    pub fn board(&self) -> &Board {
        self.board_unchecked()
    }

    fn board_unchecked(&self) -> &Board {
        // SAFETY: the mapping is page-aligned and at least `SIZE` bytes, more than
        // `size_of::<Board>()`; it is a shared, writable mapping that lives as long as
        // `self`; every byte pattern is a valid `Board` (atomic integers only); and
        // every access, from any process, goes through the atomics, never through a
        // plain reference to the bytes.
        unsafe { &*self.map.as_mut_ptr().cast::<Board>() }
    }
}

const _: () = assert!(std::mem::size_of::<Board>() as u64 <= SIZE);

/// `CLOCK_MONOTONIC` in nanoseconds: comparable between processes on one machine.
pub fn now_ns() -> u64 {
    // This clock cannot fail on Linux; 0 would only make a figure look odd.
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
                + u64::try_from(t.tv_nsec()).unwrap_or(0)
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_see_one_board() {
        let dir = std::env::temp_dir().join(format!("lockbench-board-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let created = SharedBoard::create(&dir).expect("create");
        let opened = SharedBoard::open(&dir).expect("open");
        created.board().holders.fetch_add(3, Ordering::SeqCst);
        assert_eq!(opened.board().holders.load(Ordering::SeqCst), 3);
        std::fs::remove_file(&dir).expect("remove");
    }

    #[test]
    fn other_files_are_refused() {
        let path = std::env::temp_dir().join(format!("lockbench-other-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; SIZE as usize]).expect("write");
        assert!(SharedBoard::open(&path).is_err());
        std::fs::remove_file(&path).expect("remove");
    }

    #[test]
    fn the_clock_moves_forward() {
        let a = now_ns();
        let b = now_ns();
        assert!(a > 0 && b >= a);
    }
}

//! The flight recorder's writer: puts each life's recording (see
//! `swactor_provisioning::flight`) in a file of its own under one
//! directory, on a thread of its own, within a size limit.
//!
//! - **Never blocks its caller.** [`FlightLife::append`] hands a chunk of
//!   frames to the writer thread and returns; what is handed over and not
//!   yet written is bounded ([`FlightLimits::queued_max`], in the bytes the
//!   chunks hold in memory). Past that bound the life is
//!   *cut*: its chunk is dropped and counted, the writer ends the file with
//!   [`CUT_MARKER`], and nothing more of that life is written (a recording
//!   with a hole in it could not be replayed past the hole; one that ends
//!   says so and replays up to its end).
//! - **Encodes off the caller's thread.** A chunk is anything
//!   [`FlightChunk`]: plain bytes, or frames kept in a form of their own
//!   that the writer thread turns into bytes, so that a caller that records
//!   a great many frames (the driver, in a cold converge) does not spend
//!   its own thread on encoding them.
//! - **Bounded on disk.** All recordings together stay under
//!   [`FlightLimits::disk_max`]: a new life first removes the oldest
//!   recordings of earlier lives; a life that alone would pass the limit is
//!   cut there.
//! - **Read while written.** The writer flushes whenever it has caught up,
//!   so a reader of the live file (`swactor explain` on a running daemon)
//!   sees every frame handed in up to a moment ago; a frame half written
//!   ends what the reader sees.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;

/// Ends a cut recording (the same value as the provisioning crate's
/// `flight::CUT_MARKER`, which a test checks).
pub const CUT_MARKER: u32 = u32::MAX;

/// The extension of a recording's file.
pub const EXTENSION: &str = "flight";

/// A recorder's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlightLimits {
    /// The most bytes all recordings in the directory may take.
    pub disk_max: u64,
    /// The most bytes handed to the writer and not yet written.
    pub queued_max: u64,
}

impl FlightLimits {
    /// The default limit on disk: 64 MiB.
    pub const DISK_MAX_DEFAULT: u64 = 64 << 20;

    /// Limits for `disk_max` bytes on disk, with a queue of a quarter of
    /// it (at least 1 MiB, at most 16 MiB).
    pub fn on_disk(disk_max: u64) -> Self {
        Self {
            disk_max,
            queued_max: (disk_max / 4).clamp(1 << 20, 16 << 20),
        }
    }
}

/// What a recorder did, for the daemon's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlightCounts {
    /// Lives begun.
    pub lives: u64,
    /// Bytes written to recordings (headers and frames).
    pub written_bytes: u64,
    /// Chunks of frames dropped (each cuts its life).
    pub dropped_chunks: u64,
    /// Bytes dropped (as their chunks held them in memory).
    pub dropped_bytes: u64,
    /// Lives cut.
    pub cut_lives: u64,
    /// Recordings of earlier lives removed to stay within the limit.
    pub removed: u64,
    /// Writes that failed (the life is cut at the first).
    pub write_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    lives: AtomicU64,
    written_bytes: AtomicU64,
    dropped_chunks: AtomicU64,
    dropped_bytes: AtomicU64,
    cut_lives: AtomicU64,
    removed: AtomicU64,
    write_errors: AtomicU64,
    queued: AtomicU64,
}

/// Frames as a recorder hands them to the writer: bytes already
/// (`Vec<u8>`), or a form of the recorder's own that the writer encodes.
pub trait FlightChunk: Send + 'static {
    /// An empty chunk with room for a busy step's frames.
    fn with_room() -> Self;
    /// Whether it holds no frame.
    fn is_empty(&self) -> bool;
    /// The bytes it holds in memory: what the queue's bound counts.
    fn held(&self) -> u64;
    /// Appends its frames, as the recording keeps them, to `out`.
    fn write_to(&self, out: &mut Vec<u8>);
    /// Empties it to be used again; false when it grew too big to keep.
    fn recycle(&mut self) -> bool;
}

impl FlightChunk for Vec<u8> {
    fn with_room() -> Self {
        Vec::with_capacity(BUFFER_START)
    }
    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }
    fn held(&self) -> u64 {
        self.len() as u64
    }
    fn write_to(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
    fn recycle(&mut self) -> bool {
        self.clear();
        self.capacity() <= SPARE_CAPACITY_MAX
    }
}

enum Msg<K> {
    Begin {
        life: u64,
        path: PathBuf,
        header: Vec<u8>,
    },
    Frames {
        life: u64,
        chunk: K,
    },
    Cut {
        life: u64,
    },
    /// Answers once everything sent before it is written and flushed.
    Sync(mpsc::Sender<()>),
    /// The same, for an async caller.
    Flushed(tokio::sync::oneshot::Sender<()>),
}

struct Shared<K> {
    dir: PathBuf,
    limits: FlightLimits,
    counters: Counters,
    next_life: AtomicU64,
    tx: mpsc::Sender<Msg<K>>,
    /// Chunks the writer is done with, for the next frames.
    spares: std::sync::Mutex<Vec<K>>,
}

impl<K> fmt::Debug for Shared<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("dir", &self.dir)
            .field("limits", &self.limits)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

/// Chunks kept for reuse, and the largest byte buffer kept.
const SPARES_MAX: usize = 4;
const SPARE_CAPACITY_MAX: usize = 4 << 20;

/// What a new buffer starts with, so a busy step does not grow it byte
/// by byte from nothing.
const BUFFER_START: usize = 64 << 10;

/// Once it has caught up, the writer looks for more frames after this
/// long, then after twice as long each time it finds none, up to
/// [`LOOK_LAST`]; after that it waits to be woken. So it picks up a busy
/// driver's frames within a fraction of a millisecond (what is queued, and
/// the memory it holds, stays small), and an idle daemon's writer wakes
/// only a few times after each step.
const LOOK_FIRST: std::time::Duration = std::time::Duration::from_micros(100);
const LOOK_LAST: std::time::Duration = std::time::Duration::from_micros(3_200);

/// A daemon's flight recorder: one writer thread, one directory, chunks
/// of frames of the kind `K`.
#[derive(Debug)]
pub struct FlightRecorder<K: FlightChunk = Vec<u8>> {
    shared: Arc<Shared<K>>,
}

impl<K: FlightChunk> Clone for FlightRecorder<K> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<K: FlightChunk> FlightRecorder<K> {
    /// Opens `dir` (made if missing, private to the user) and starts the
    /// writer thread, which ends once the recorder and every life it began
    /// are dropped.
    ///
    /// # Errors
    /// The directory cannot be made, or the thread cannot be started.
    pub fn open(dir: &Path, limits: FlightLimits) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            limits,
            counters: Counters::default(),
            next_life: AtomicU64::new(0),
            tx,
            spares: std::sync::Mutex::new(Vec::new()),
        });
        let writer = Writer {
            shared: Arc::downgrade(&shared),
            dir: dir.to_owned(),
            limits,
            current: None,
            scratch: Vec::new(),
        };
        std::thread::Builder::new()
            .name("flight-writer".to_owned())
            .spawn(move || writer.run(&rx))?;
        Ok(Self { shared })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Begins a life: a new recording that starts with `header`, named so
    /// that recordings sort by when they began (`wall_ms`).
    pub fn begin(&self, header: Vec<u8>, wall_ms: u64) -> FlightLife<K> {
        let life = self.shared.next_life.fetch_add(1, Ordering::Relaxed);
        self.shared.counters.lives.fetch_add(1, Ordering::Relaxed);
        let path = self.shared.dir.join(format!(
            "{wall_ms:013}-{pid}-{life}.{EXTENSION}",
            pid = std::process::id()
        ));
        let queued = header.len() as u64;
        self.shared
            .counters
            .queued
            .fetch_add(queued, Ordering::Relaxed);
        let sent = self.shared.tx.send(Msg::Begin {
            life,
            path: path.clone(),
            header,
        });
        FlightLife {
            shared: self.shared.clone(),
            life,
            path,
            cut: AtomicBool::new(sent.is_err()),
        }
    }

    /// What it did so far.
    pub fn counts(&self) -> FlightCounts {
        let c = &self.shared.counters;
        FlightCounts {
            lives: c.lives.load(Ordering::Relaxed),
            written_bytes: c.written_bytes.load(Ordering::Relaxed),
            dropped_chunks: c.dropped_chunks.load(Ordering::Relaxed),
            dropped_bytes: c.dropped_bytes.load(Ordering::Relaxed),
            cut_lives: c.cut_lives.load(Ordering::Relaxed),
            removed: c.removed.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
        }
    }

    /// Resolves once everything handed in so far is written and flushed
    /// (a daemon about to exit waits for it).
    pub async fn flushed(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.shared.tx.send(Msg::Flushed(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Blocks until everything handed in so far is written and flushed
    /// (for tests and benchmarks).
    pub fn sync(&self) {
        let (tx, rx) = mpsc::channel();
        if self.shared.tx.send(Msg::Sync(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

/// One life's recording, being written.
#[derive(Debug)]
pub struct FlightLife<K: FlightChunk = Vec<u8>> {
    shared: Arc<Shared<K>>,
    life: u64,
    path: PathBuf,
    cut: AtomicBool,
}

impl<K: FlightChunk> FlightLife<K> {
    /// Where it is written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether it was cut (nothing more of it is written).
    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }

    /// An empty chunk to record the next frames in: one the writer is
    /// done with when there is one, so a busy daemon does not grow a new
    /// buffer for every step.
    pub fn spare(&self) -> K {
        self.shared
            .spares
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
            .unwrap_or_else(K::with_room)
    }

    /// Appends frames; never waits. Past the queue's bound the life is cut
    /// and the chunk dropped (counted).
    pub fn append(&self, chunk: K) {
        if chunk.is_empty() {
            return;
        }
        let c = &self.shared.counters;
        let len = chunk.held();
        if self.is_cut() {
            c.dropped_chunks.fetch_add(1, Ordering::Relaxed);
            c.dropped_bytes.fetch_add(len, Ordering::Relaxed);
            return;
        }
        let queued = c.queued.fetch_add(len, Ordering::Relaxed) + len;
        if queued > self.shared.limits.queued_max {
            c.queued.fetch_sub(len, Ordering::Relaxed);
            self.cut_here(len);
            return;
        }
        let life = self.life;
        if self.shared.tx.send(Msg::Frames { life, chunk }).is_err() {
            c.queued.fetch_sub(len, Ordering::Relaxed);
            self.cut_here(len);
        }
    }

    /// Counts frames its recorder dropped before they reached this life
    /// (the host's own buffer was full): the recording was cut there, by
    /// the recorder, with the same marker.
    pub fn dropped_upstream(&self, frames: u64) {
        if frames == 0 {
            return;
        }
        let c = &self.shared.counters;
        c.dropped_chunks.fetch_add(frames, Ordering::Relaxed);
        if !self.cut.swap(true, Ordering::Relaxed) {
            c.cut_lives.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn cut_here(&self, dropped: u64) {
        let c = &self.shared.counters;
        c.dropped_chunks.fetch_add(1, Ordering::Relaxed);
        c.dropped_bytes.fetch_add(dropped, Ordering::Relaxed);
        if !self.cut.swap(true, Ordering::Relaxed) {
            let _ = self.shared.tx.send(Msg::Cut { life: self.life });
        }
    }
}

/// The open recording of the life being written.
struct Current {
    life: u64,
    path: PathBuf,
    out: BufWriter<File>,
    len: u64,
    cut: bool,
}

struct Writer<K> {
    shared: std::sync::Weak<Shared<K>>,
    dir: PathBuf,
    limits: FlightLimits,
    current: Option<Current>,
    /// A chunk's frames, encoded.
    scratch: Vec<u8>,
}

impl<K: FlightChunk> Writer<K> {
    fn run(mut self, rx: &mpsc::Receiver<Msg<K>>) {
        let mut look = LOOK_FIRST;
        loop {
            // Once caught up, flush so readers see it. Within a burst, look
            // again a moment later rather than wait on the channel: a
            // thread waiting on it has to be woken by every send, a cost
            // the sender (the driver) would pay a thousand times a second.
            // Only after a few empty looks does it wait.
            let msg = match rx.try_recv() {
                Ok(m) => {
                    look = LOOK_FIRST;
                    m
                }
                Err(mpsc::TryRecvError::Empty) => {
                    self.flush();
                    if look <= LOOK_LAST {
                        std::thread::sleep(look);
                        look *= 2;
                        continue;
                    }
                    match rx.recv() {
                        Ok(m) => m,
                        Err(_) => break,
                    }
                }
                Err(mpsc::TryRecvError::Disconnected) => break,
            };
            self.handle(msg);
        }
        self.flush();
    }

    fn counters<R>(&self, f: impl FnOnce(&Counters) -> R) -> Option<R> {
        self.shared.upgrade().map(|s| f(&s.counters))
    }

    fn handle(&mut self, msg: Msg<K>) {
        match msg {
            Msg::Begin { life, path, header } => {
                let len = header.len() as u64;
                self.flush();
                self.current = None;
                self.make_room(len);
                let mut options = OpenOptions::new();
                options.create_new(true).write(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
                let opened = options.open(&path).map(BufWriter::new);
                let mut cur = match opened {
                    Ok(out) => Current {
                        life,
                        path,
                        out,
                        len: 0,
                        cut: false,
                    },
                    Err(e) => {
                        self.failed(&path, &e);
                        self.counters(|c| c.queued.fetch_sub(len, Ordering::Relaxed));
                        return;
                    }
                };
                if let Err(e) = cur.out.write_all(&header) {
                    self.failed(&cur.path, &e);
                    cur.cut = true;
                } else {
                    cur.len = len;
                    self.counters(|c| c.written_bytes.fetch_add(len, Ordering::Relaxed));
                }
                self.counters(|c| c.queued.fetch_sub(len, Ordering::Relaxed));
                self.current = Some(cur);
            }
            Msg::Frames { life, chunk } => {
                let held = chunk.held();
                self.counters(|c| c.queued.fetch_sub(held, Ordering::Relaxed));
                let disk_max = self.limits.disk_max;
                let Some(cur) = self.current.as_mut().filter(|c| c.life == life) else {
                    return;
                };
                if cur.cut {
                    if let Some(s) = self.shared.upgrade() {
                        s.counters.dropped_chunks.fetch_add(1, Ordering::Relaxed);
                        s.counters.dropped_bytes.fetch_add(held, Ordering::Relaxed);
                    }
                    return;
                }
                self.scratch.clear();
                chunk.write_to(&mut self.scratch);
                let len = self.scratch.len() as u64;
                if cur.len + len + 4 > disk_max {
                    // This life alone would pass the limit: it ends here.
                    self.cut_current(len);
                    return;
                }
                match cur.out.write_all(&self.scratch) {
                    Ok(()) => {
                        cur.len += len;
                        if let Some(s) = self.shared.upgrade() {
                            s.counters.written_bytes.fetch_add(len, Ordering::Relaxed);
                            let mut chunk = chunk;
                            if chunk.recycle() {
                                let mut spares = s
                                    .spares
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                                if spares.len() < SPARES_MAX {
                                    spares.push(chunk);
                                }
                            }
                        }
                        if self.scratch.capacity() > SPARE_CAPACITY_MAX {
                            self.scratch = Vec::new();
                        }
                    }
                    Err(e) => {
                        let path = cur.path.clone();
                        self.failed(&path, &e);
                        self.cut_current(0);
                    }
                }
            }
            Msg::Cut { life } => {
                if self.current.as_ref().is_some_and(|c| c.life == life) {
                    self.cut_current(0);
                }
            }
            Msg::Sync(done) => {
                self.flush();
                let _ = done.send(());
            }
            Msg::Flushed(done) => {
                self.flush();
                let _ = done.send(());
            }
        }
    }

    /// Ends the current life's recording with the cut marker.
    fn cut_current(&mut self, dropped: u64) {
        let shared = self.shared.upgrade();
        if dropped > 0
            && let Some(s) = &shared
        {
            s.counters.dropped_chunks.fetch_add(1, Ordering::Relaxed);
            s.counters
                .dropped_bytes
                .fetch_add(dropped, Ordering::Relaxed);
        }
        let Some(cur) = self.current.as_mut() else {
            return;
        };
        if cur.cut {
            return;
        }
        cur.cut = true;
        let _ = cur.out.write_all(&CUT_MARKER.to_le_bytes());
        let _ = cur.out.flush();
        if let Some(s) = &shared {
            s.counters.cut_lives.fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(
            recording = %cur.path.display(),
            "the flight recorder fell behind or reached its limit: this life's recording ends here"
        );
    }

    fn flush(&mut self) {
        if let Some(cur) = self.current.as_mut()
            && let Err(e) = cur.out.flush()
        {
            let path = cur.path.clone();
            self.failed(&path, &e);
            self.cut_current(0);
        }
    }

    fn failed(&self, path: &Path, e: &io::Error) {
        self.counters(|c| c.write_errors.fetch_add(1, Ordering::Relaxed));
        tracing::warn!(recording = %path.display(), error = %e, "the flight recorder could not write");
    }

    /// Removes the oldest recordings until `more` bytes fit in the limit.
    fn make_room(&self, more: u64) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(String, PathBuf, u64)> = entries
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == EXTENSION))
            .filter_map(|e| {
                let len = e.metadata().ok()?.len();
                Some((e.file_name().to_string_lossy().into_owned(), e.path(), len))
            })
            .collect();
        files.sort();
        let mut total: u64 = files.iter().map(|f| f.2).sum::<u64>() + more;
        for (_, path, len) in files {
            if total <= self.limits.disk_max {
                break;
            }
            if fs::remove_file(&path).is_ok() {
                total -= len;
                self.counters(|c| c.removed.fetch_add(1, Ordering::Relaxed));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_life_is_written_in_order_and_readable_before_it_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let rec = FlightRecorder::open(tmp.path(), FlightLimits::on_disk(1 << 20)).unwrap();
        let life = rec.begin(b"HEAD".to_vec(), 1_000);
        life.append(b"one".to_vec());
        life.append(b"two".to_vec());
        rec.sync();
        assert_eq!(fs::read(life.path()).unwrap(), b"HEADonetwo");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!((mode(tmp.path()), mode(life.path())), (0o700, 0o600));
        }
        let counts = rec.counts();
        assert_eq!(counts.written_bytes, 10);
        assert_eq!(counts.dropped_chunks, 0);
        // A second life is a second file, sorted after the first.
        let second = rec.begin(b"H2".to_vec(), 2_000);
        second.append(b"x".to_vec());
        rec.sync();
        assert_eq!(files(tmp.path()), [life.path(), second.path()]);
        assert_eq!(fs::read(second.path()).unwrap(), b"H2x");
    }

    #[test]
    fn a_life_past_the_limit_is_cut_and_older_lives_make_room() {
        let tmp = tempfile::tempdir().unwrap();
        let limits = FlightLimits {
            disk_max: 100,
            queued_max: 1 << 20,
        };
        let rec = FlightRecorder::open(tmp.path(), limits).unwrap();
        let first = rec.begin(vec![1; 10], 1);
        first.append(vec![2; 80]);
        rec.sync();
        assert_eq!(fs::metadata(first.path()).unwrap().len(), 90);
        // The second life needs room: the first goes.
        let second = rec.begin(vec![3; 30], 2);
        rec.sync();
        assert!(!first.path().exists());
        assert_eq!(rec.counts().removed, 1);
        second.append(vec![4; 50]);
        // Past the limit: cut, then nothing more.
        second.append(vec![5; 50]);
        second.append(vec![6; 5]);
        rec.sync();
        let mut want = vec![3; 30];
        want.extend([4; 50]);
        want.extend(CUT_MARKER.to_le_bytes());
        assert_eq!(fs::read(second.path()).unwrap(), want);
        let counts = rec.counts();
        assert_eq!(counts.cut_lives, 1);
        assert_eq!(counts.dropped_chunks, 2);
    }

    /// Numbers written out as four bytes each, held as sixteen: more in
    /// memory than on disk, as the driver's kept frames are.
    #[derive(Debug, Default)]
    struct Numbers(Vec<u32>);

    impl FlightChunk for Numbers {
        fn with_room() -> Self {
            // None, so a chunk with room is one that came back.
            Self(Vec::new())
        }
        fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
        fn held(&self) -> u64 {
            self.0.len() as u64 * 16
        }
        fn write_to(&self, out: &mut Vec<u8>) {
            for n in &self.0 {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        fn recycle(&mut self) -> bool {
            self.0.clear();
            true
        }
    }

    #[test]
    fn the_writer_encodes_chunks_and_the_queue_counts_what_they_hold() {
        let tmp = tempfile::tempdir().unwrap();
        let limits = FlightLimits {
            disk_max: 1 << 20,
            queued_max: 64,
        };
        let rec: FlightRecorder<Numbers> = FlightRecorder::open(tmp.path(), limits).unwrap();
        let life = rec.begin(b"HEAD".to_vec(), 1);
        let mut chunk = life.spare();
        chunk.0.extend([1, 2]);
        life.append(chunk);
        rec.sync();
        let mut want = b"HEAD".to_vec();
        want.extend(1u32.to_le_bytes());
        want.extend(2u32.to_le_bytes());
        assert_eq!(fs::read(life.path()).unwrap(), want);
        assert_eq!(rec.counts().written_bytes, 12);
        // The chunk came back, emptied, for the next frames.
        let spare = life.spare();
        assert!(spare.0.is_empty() && spare.0.capacity() >= 2);
        // Five numbers take 20 bytes on disk but hold 80 in memory: past
        // the queue's bound of 64, so the life is cut.
        life.append(Numbers(vec![7; 5]));
        assert!(life.is_cut());
        rec.sync();
        want.extend(CUT_MARKER.to_le_bytes());
        assert_eq!(fs::read(life.path()).unwrap(), want);
        let counts = rec.counts();
        assert_eq!((counts.dropped_chunks, counts.dropped_bytes), (1, 80));
    }

    #[test]
    fn a_queue_past_its_bound_cuts_the_life_without_waiting() {
        let tmp = tempfile::tempdir().unwrap();
        let limits = FlightLimits {
            disk_max: 1 << 30,
            queued_max: 64,
        };
        let rec = FlightRecorder::open(tmp.path(), limits).unwrap();
        let life = rec.begin(vec![0; 8], 1);
        // One chunk over the queue's bound: dropped and the life cut,
        // whatever the writer has done meanwhile.
        life.append(vec![1; 100]);
        assert!(life.is_cut());
        life.append(vec![2; 4]);
        rec.sync();
        let mut want = vec![0; 8];
        want.extend(CUT_MARKER.to_le_bytes());
        assert_eq!(fs::read(life.path()).unwrap(), want);
        assert_eq!(rec.counts().dropped_chunks, 2);
        assert_eq!(rec.counts().dropped_bytes, 104);
        // Frames the host's recorder dropped itself are counted, and cut
        // the life once.
        let other = rec.begin(vec![0; 8], 2);
        other.dropped_upstream(3);
        other.dropped_upstream(1);
        assert!(other.is_cut());
        let counts = rec.counts();
        assert_eq!((counts.dropped_chunks, counts.cut_lives), (6, 2));
    }
}

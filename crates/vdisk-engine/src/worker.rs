//! A worker of the thread engine: takes a batch from its device's queue, maps
//! every request through the image, performs the data extents with as few
//! vectored calls as the batch allows, then the other operations, then hands
//! the completions back grouped by sink.

use std::sync::Arc;

use vdisk_image::{Error, ErrorKind, Extent, Image, Result};

use crate::queue::{Job, Queue};
use crate::sys::{self, Segment, IOV_MAX};
use crate::{EngineConfig, Op, Request, Sink};

pub(crate) struct Worker {
    image: Arc<dyn Image>,
    queue: Arc<Queue>,
    batch: usize,
    sync: bool,
    coalesce: bool,
    extents: Vec<Extent>,
}

/// One contiguous piece of a read or write, in one file.
struct Piece {
    write: bool,
    dsync: bool,
    file: usize,
    offset: u64,
    job: usize,
    seg: Segment,
}

impl Worker {
    pub fn new(image: Arc<dyn Image>, queue: Arc<Queue>, config: &EngineConfig) -> Self {
        Worker {
            image,
            queue,
            batch: config.batch.max(1),
            sync: config.sync,
            coalesce: config.coalesce,
            extents: Vec::new(),
        }
    }

    pub fn run(mut self) {
        let mut jobs = Vec::with_capacity(self.batch);
        while self.queue.take(self.batch, &mut jobs) {
            self.execute(&mut jobs);
            deliver(&mut jobs);
        }
    }

    fn execute(&mut self, jobs: &mut [Job]) {
        let pieces = self.map_data(jobs);
        self.run_pieces(jobs, pieces);
        let mut flush = false;
        for (req, _) in jobs.iter_mut() {
            let r = match req.op {
                Op::Read | Op::Write => continue,
                Op::Flush => {
                    flush = true;
                    continue;
                }
                Op::Trim | Op::WriteZeroes => self.deallocate(req),
                Op::Cache => self.cache(req),
                Op::BlockStatus => {
                    let max = req.max_status.max(1);
                    self.image.allocation(req.offset, req.len, max, &mut req.status)
                }
            };
            if let Err(e) = r {
                req.error.get_or_insert(e);
            }
        }
        if flush {
            let r = flush_image(self.image.as_ref());
            for (req, _) in jobs.iter_mut().filter(|(r, _)| r.op == Op::Flush) {
                if let Err(e) = &r {
                    req.error = Some(Error::new(e.kind(), e.to_string()));
                }
            }
        }
    }

    /// Maps reads and writes to pieces of files; fills the zero extents of reads.
    fn map_data(&mut self, jobs: &mut [Job]) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for (i, (req, _)) in jobs.iter_mut().enumerate() {
            let write = match req.op {
                Op::Read => false,
                Op::Write => true,
                _ => continue,
            };
            if write && self.image.read_only() {
                req.error = Some(Error::new(ErrorKind::ReadOnly, "the device is read-only"));
                continue;
            }
            if req.buf.len() as u64 != req.len {
                if write {
                    req.error = Some(Error::invalid("write buffer does not match its length"));
                    continue;
                }
                req.buf.resize(req.len as usize, 0);
            }
            self.extents.clear();
            let mapped = if write {
                self.image.map_write(req.offset, req.len, &mut self.extents)
            } else {
                self.image.map_read(req.offset, req.len, &mut self.extents)
            };
            if let Err(e) = mapped {
                req.error = Some(e);
                continue;
            }
            let dsync = write && (self.sync || req.flags.fua);
            let mut at = 0usize;
            for ext in &self.extents {
                let len = ext.len() as usize;
                let region = &mut req.buf[at..at + len];
                match *ext {
                    Extent::Data { file, offset, .. } => pieces.push(Piece {
                        write,
                        dsync,
                        file,
                        offset,
                        job: i,
                        seg: Segment { ptr: region.as_mut_ptr(), len },
                    }),
                    Extent::Zero { .. } if !write => region.fill(0),
                    Extent::Zero { .. } => {}
                }
                at += len;
            }
        }
        pieces
    }

    /// Performs the pieces; with coalescing, contiguous pieces of the same kind
    /// share one vectored call. A failed merged call is retried piece by piece so
    /// only the requests that really failed see the error.
    fn run_pieces(&self, jobs: &mut [Job], mut pieces: Vec<Piece>) {
        if self.coalesce {
            pieces.sort_by_key(|p| (p.write, p.dsync, p.file, p.offset));
        }
        let mut start = 0;
        while start < pieces.len() {
            let mut end = start + 1;
            let mut next = pieces[start].offset + pieces[start].seg.len as u64;
            while self.coalesce && end < pieces.len() && end - start < IOV_MAX {
                let (a, b) = (&pieces[start], &pieces[end]);
                if (b.write, b.dsync, b.file, b.offset) != (a.write, a.dsync, a.file, next) {
                    break;
                }
                next += b.seg.len as u64;
                end += 1;
            }
            let run = &pieces[start..end];
            if self.perform(run).is_err() {
                for p in run {
                    if let Err(e) = self.perform(std::slice::from_ref(p)) {
                        jobs[p.job].0.error.get_or_insert(e);
                    }
                }
            }
            start = end;
        }
    }

    fn perform(&self, run: &[Piece]) -> Result<()> {
        let first = &run[0];
        let file = &self.image.files()[first.file];
        let segs: Vec<Segment> = run.iter().map(|p| p.seg).collect();
        // The segments point into the buffers of requests this worker owns until
        // it delivers them, and no two pieces overlap: `Segment`'s promise holds.
        let r = if first.write {
            sys::pwritev_full(file, &segs, first.offset, first.dsync)
        } else {
            sys::preadv_full(file, &segs, first.offset)
        };
        r.map_err(|e| {
            let what = if first.write { "write" } else { "read" };
            let len: usize = segs.iter().map(|s| s.len).sum();
            Error::io(e, format!("{what} of {len} bytes at offset {} of {}", first.offset, self.describe(first.file)))
        })
    }

    fn describe(&self, file: usize) -> String {
        self.image.file_path(file).display().to_string()
    }

    /// TRIM and WRITE_ZEROES.
    fn deallocate(&mut self, req: &Request) -> Result<()> {
        if self.image.read_only() {
            return Err(Error::new(ErrorKind::ReadOnly, "the device is read-only"));
        }
        self.extents.clear();
        self.image.map_write(req.offset, req.len, &mut self.extents)?;
        for ext in &self.extents {
            let Extent::Data { file: f, offset, len } = *ext else { continue };
            let file = &self.image.files()[f];
            let at =
                |e| Error::io(e, format!("{:?} of {len} bytes at offset {offset} of {}", req.op, self.describe(f)));
            if req.op == Op::Trim {
                match sys::fallocate(file, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len) {
                    Ok(()) => {}
                    // TRIM is advisory: a file system that cannot punch keeps the data.
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                    Err(e) => return Err(at(e)),
                }
                continue;
            }
            zero_range(file, offset, len, req.flags.no_hole, req.flags.fast_zero).map_err(at)?;
        }
        if self.sync || req.flags.fua {
            for (i, file) in self.image.files().iter().enumerate() {
                sys::fdatasync(file).map_err(|e| Error::io(e, format!("sync of {}", self.describe(i))))?;
            }
        }
        Ok(())
    }

    fn cache(&mut self, req: &Request) -> Result<()> {
        self.extents.clear();
        self.image.map_read(req.offset, req.len, &mut self.extents)?;
        for ext in &self.extents {
            if let Extent::Data { file, offset, len } = *ext {
                sys::readahead(&self.image.files()[file], offset, len);
            }
        }
        Ok(())
    }
}

/// Makes a range read as zeros: a punched hole where holes are allowed, else a
/// zeroed (allocated) range, else written zeros unless the caller wants fast only.
fn zero_range(file: &std::fs::File, offset: u64, len: u64, no_hole: bool, fast: bool) -> std::io::Result<()> {
    let unsupported = |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENODEV));
    if !no_hole {
        match sys::fallocate(file, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len) {
            Ok(()) => return Ok(()),
            Err(e) if unsupported(&e) => {}
            Err(e) => return Err(e),
        }
    }
    match sys::fallocate(file, libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, offset, len) {
        Ok(()) => return Ok(()),
        Err(e) if unsupported(&e) && fast => return Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
        Err(e) if unsupported(&e) => {}
        Err(e) => return Err(e),
    }
    const CHUNK: u64 = 1 << 20;
    let mut zeros = vec![0u8; CHUNK.min(len) as usize];
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at) as usize;
        let seg = Segment { ptr: zeros.as_mut_ptr(), len: n };
        sys::pwritev_full(file, &[seg], offset + at, false)?;
        at += n as u64;
    }
    Ok(())
}

/// Syncs every file of the image, then its metadata: data before the metadata
/// that points at it.
pub(crate) fn flush_image(image: &dyn Image) -> Result<()> {
    for (i, file) in image.files().iter().enumerate() {
        sys::fdatasync(file).map_err(|e| Error::io(e, format!("flush of {}", image.file_path(i).display())))?;
    }
    image.sync_metadata()
}

/// Hands each sink its completed requests in one call.
fn deliver(jobs: &mut Vec<Job>) {
    let mut groups: Vec<(Arc<dyn Sink>, Vec<Request>)> = Vec::new();
    for (req, sink) in jobs.drain(..) {
        match groups.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &sink)) {
            Some((_, reqs)) => reqs.push(req),
            None => groups.push((sink, vec![req])),
        }
    }
    for (sink, reqs) in groups {
        sink.complete(reqs);
    }
}

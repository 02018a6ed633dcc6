//! Entry points for the fuzz targets in `fuzz/` (cargo-fuzz) and for the
//! tests that replay their corpora. Not an API: it exists so the targets can
//! reach the handshake and the edge validation without making `conn` public.
//!
//! The property every entry point checks is "no panic, whatever the bytes";
//! a few invariants of the results are asserted on top of that.

use std::io::{self, Read, Write};
use std::sync::Arc;

use vdisk_engine::{Device, EngineConfig, EngineKind, Op};
use vdisk_image::{Allocation, Extent, Image, ImageBase};

use crate::handshake::{handshake, Negotiated};
use crate::proto::*;
use crate::reply::refusal;
use crate::Export;

/// An image that only has a size (and no files): the handshake asks nothing
/// else of a device.
struct SizeOnly {
    base: ImageBase,
}

impl Image for SizeOnly {
    fn format(&self) -> &'static str {
        "fuzz"
    }
    fn base(&self) -> &ImageBase {
        &self.base
    }
    fn map_read(&self, _offset: u64, _len: u64, _out: &mut Vec<Extent>) -> vdisk_image::Result<()> {
        Err(vdisk_image::Error::invalid("the fuzzing image holds no data"))
    }
    fn map_write(&self, _offset: u64, _len: u64, _out: &mut Vec<Extent>) -> vdisk_image::Result<()> {
        Err(vdisk_image::Error::invalid("the fuzzing image holds no data"))
    }
    fn allocation(&self, _offset: u64, _len: u64, _max: usize, _out: &mut Vec<Allocation>) -> vdisk_image::Result<()> {
        Err(vdisk_image::Error::invalid("the fuzzing image holds no data"))
    }
}

/// Exports of the given (name, size, read-only) over images that hold no data.
/// Each starts a device with one worker thread; build them once per process.
pub fn exports(list: &[(&str, u64, bool)]) -> Vec<Export> {
    let config = EngineConfig { kind: EngineKind::Threads, workers: 1, ..EngineConfig::default() };
    list.iter()
        .map(|&(name, size, read_only)| {
            let image: Arc<dyn Image> =
                Arc::new(SizeOnly { base: ImageBase::new("fuzz".into(), size, read_only, Vec::new()) });
            let device = Device::start(name, image, &config).expect("start a fuzzing device");
            Export {
                name: name.to_owned(),
                description: format!("fuzz export {name}"),
                device: Arc::new(device),
                allow: Default::default(),
            }
        })
        .collect()
}

/// The exports the targets use: a writable one, a read-only one, and a huge one.
pub fn default_exports() -> Vec<Export> {
    exports(&[("disk", 1 << 20, false), ("ro", 4096, true), ("big", u64::MAX / 2, false)])
}

/// A client made of bytes: reads come from the input, writes are counted and dropped.
struct Scripted<'a> {
    input: &'a [u8],
    written: usize,
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.written += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl crate::handshake::Transport for Scripted<'_> {
    fn start_tls(&mut self, _: &crate::tls::Tls) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "no TLS when fuzzing"))
    }
}

/// Runs the server's handshake with `input` as everything the client sends.
/// The first byte, when present, says whether the server is shutting down
/// (bit 0) and whether listing and the default export are off (bit 1); the
/// rest is the client's stream. Returns what was negotiated.
pub fn handshake_input(input: &[u8], exports: &[Export]) -> Option<Negotiated> {
    let (flags, stream) = match input.split_first() {
        Some((&b, rest)) => (b, rest),
        None => (0, input),
    };
    let shutting = flags & 1 != 0;
    let strict = flags & 2 != 0;
    let policy = crate::Policy { tls: None, list: !strict, default_export: !strict };
    let mut s = Scripted { input: stream, written: 0 };
    let neg = handshake(&mut s, exports, &policy, &|| shutting).ok()?;
    assert!(neg.export < exports.len(), "negotiated export {} of {}", neg.export, exports.len());
    if !neg.contexts.is_empty() {
        assert!(neg.structured, "a meta context without structured replies");
    }
    Some(neg)
}

/// Parses `input` as a transmission-phase request stream the way the
/// connection's reader does (header, then a WRITE's payload), runs each
/// header through the edge validation and encodes the refusals. The first
/// byte picks what was negotiated and the export: bit 0 structured replies,
/// bit 1 base:allocation, bit 2 read-only, bits 3..5 the export size (a few
/// fixed ones including 0 and u64::MAX). Returns the number of requests the
/// edge accepted.
pub fn requests_input(input: &[u8]) -> usize {
    const SIZES: [u64; 8] = [0, 1, 512, 4096, 1 << 20, 1 << 40, u64::MAX - 4095, u64::MAX];
    let Some((&sel, mut rest)) = input.split_first() else { return 0 };
    let structured = sel & 1 != 0;
    let contexts = if sel & 2 != 0 {
        vec![crate::meta::Selected { id: 1, context: crate::meta::Context::BaseAllocation }]
    } else {
        Vec::new()
    };
    let neg = Negotiated { export: 0, structured, contexts, transmission_flags: 0 };
    let read_only = sel & 4 != 0;
    let size = SIZES[usize::from((sel >> 3) & 7)];
    let mut accepted = 0;
    while rest.len() >= REQUEST_HEADER {
        let h = RequestHeader::parse(rest[..REQUEST_HEADER].try_into().unwrap());
        rest = &rest[REQUEST_HEADER..];
        if h.magic != REQUEST_MAGIC || h.kind == CMD_DISC {
            break;
        }
        let payload = h.payload_len();
        match crate::conn::validate(&h, &neg, size, read_only) {
            Ok(v) => {
                accepted += 1;
                if v.op == Op::Flush {
                    assert!(h.offset == 0 && h.len == 0, "a FLUSH with a range passed: {h:?}");
                } else {
                    let end = h.offset.checked_add(h.len as u64);
                    assert!(h.len > 0 && end.is_some_and(|e| e <= size), "out of range passed: {h:?} size {size}");
                }
                if v.op.is_data() {
                    assert!(h.len <= MAX_REQUEST, "an oversized request passed: {h:?}");
                }
                if v.op.writes() {
                    assert!(!read_only, "a write passed on a read-only export: {h:?}");
                }
                if matches!(v.op, Op::BlockStatus { .. }) {
                    assert!(!neg.contexts.is_empty(), "BLOCK_STATUS passed without a context: {h:?}");
                }
                // FUA is allowed everywhere but means something only where data is written.
                if v.op.writes() {
                    assert!(v.op.fua() == (h.flags & CMD_FLAG_FUA != 0), "FUA lost: {h:?}");
                }
            }
            Err(errno) => {
                let _ = refusal(structured, h.kind, h.cookie, errno);
            }
        }
        if payload > rest.len() {
            break; // the client left mid-payload
        }
        rest = &rest[payload..];
    }
    accepted
}

/// The meta-context options: byte 0 picks LIST (bit 0 clear) or SET, and
/// whether structured replies were negotiated first (bit 1); the rest is
/// the option's data (export name, queries). It runs through the option
/// parser and matcher (checking that SET picks only whole names, each once)
/// and through the whole handshake (the option, then NBD_OPT_GO for
/// "disk", then block status of every selected context encoded once).
/// Returns the number of contexts the handshake agreed on, if it got to GO.
pub fn meta_context_input(input: &[u8], exports: &[Export]) -> Option<usize> {
    use crate::meta;
    let (&sel, data) = input.split_first()?;
    let set = sel & 1 != 0;
    let bitmap = |g| Arc::new(vdisk_image::bitmap::DirtyBitmap::new(1 << 20, g).unwrap());
    let served: meta::ServedBitmaps = Arc::new([("b0".to_owned(), bitmap(65536)), ("b:1".to_owned(), bitmap(512))]);
    if let Some((_, queries)) = meta::parse(data) {
        let offered = meta::offered(&served);
        let chosen = meta::matching(&offered, &queries, !set);
        let mut ids: Vec<u32> = chosen.iter().map(|c| c.id).collect();
        ids.dedup();
        assert_eq!(ids.len(), chosen.len(), "a context chosen twice");
        assert!(chosen.iter().all(|c| c.id >= 1 && c.id as usize <= offered.len()));
        if set {
            assert!(chosen.iter().all(|c| queries.contains(&c.context.name())), "SET picked by a namespace");
        }
        served[0].1.set(4096, 1);
        let runs = [Allocation { len: 8192, hole: false, zero: false, depth: 2 }];
        let mut out = Head::new();
        meta::encode_block_status(&mut out, 1, &chosen, (0, 1 << 20), &runs, usize::from(sel >> 2));
    }
    // The client's flags, then its options.
    let mut stream = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
    let mut option = |opt: u32, body: &[u8]| {
        stream.extend_from_slice(&IHAVEOPT.to_be_bytes());
        stream.extend_from_slice(&opt.to_be_bytes());
        stream.extend_from_slice(&(body.len() as u32).to_be_bytes());
        stream.extend_from_slice(body);
    };
    if sel & 2 != 0 {
        option(OPT_STRUCTURED_REPLY, &[]);
    }
    option(if set { OPT_SET_META_CONTEXT } else { OPT_LIST_META_CONTEXT }, data);
    let mut go = 4u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"disk");
    go.extend_from_slice(&0u16.to_be_bytes());
    option(OPT_GO, &go);
    let mut s = Scripted { input: &stream, written: 0 };
    let policy = crate::Policy::default();
    let bitmaps = vec![served; exports.len()];
    let neg = crate::handshake::handshake_with_bitmaps(&mut s, exports, &bitmaps, &policy, &|| false).ok()?;
    assert!(neg.contexts.is_empty() || (neg.structured && set), "contexts without SET and structured replies");
    Some(neg.contexts.len())
}

/// Parses `input` as a COW overlay header; on success checks that the
/// header's own arithmetic holds and that it survives a write and re-read
/// when it is in the layout this code writes.
pub fn cow_header_input(input: &[u8]) {
    use vdisk_image::cow::{parse_header, Layout};
    let Ok(h) = parse_header(input) else { return };
    assert!(h.size > 0);
    let (bitmap, data) = (h.bitmap_offset(), h.data_offset());
    assert!(bitmap + h.bitmap_len() <= data, "bitmap runs into the data: {h:?}");
    let _ = h.sectors();
    let _ = h.backing_path();
    if h.layout == Layout::Packed {
        let again = parse_header(&h.to_bytes()).expect("a written header parses");
        assert_eq!(again, h, "a header changed across a write and a read");
    }
}

#[cfg(test)]
mod tests {
    //! Replays the fuzz corpora (`fuzz/corpus/TARGET/`) and a few thousand
    //! mutations of them, so the no-panic property is checked by a plain
    //! `cargo test` too.

    use super::*;
    use std::path::PathBuf;

    fn corpus(target: &str) -> Vec<Vec<u8>> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
        let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(|e| std::fs::read(e.ok()?.path()).ok()).collect())
            .unwrap_or_default();
        seeds.push(Vec::new());
        seeds
    }

    /// xorshift64*: deterministic, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// A seed with a few bytes flipped, replaced, cut or inserted.
    fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        for _ in 0..1 + rng.below(8) {
            match rng.below(5) {
                0 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] ^= 1 << rng.below(8);
                }
                1 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] = [0, 0xff, 0x7f, 0x80, rng.next() as u8][rng.below(5)];
                }
                2 if !v.is_empty() => {
                    let at = rng.below(v.len());
                    v.truncate(at);
                }
                3 => {
                    let at = rng.below(v.len() + 1);
                    v.insert(at, rng.next() as u8);
                }
                _ => v.extend((0..rng.below(32)).map(|_| rng.next() as u8)),
            }
        }
        v
    }

    fn replay(target: &str, runs: usize, f: &mut dyn FnMut(&[u8])) {
        let seeds = corpus(target);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ target.len() as u64);
        for s in &seeds {
            f(s);
        }
        for _ in 0..runs {
            let seed = &seeds[rng.below(seeds.len())];
            f(&mutate(&mut rng, seed));
        }
    }

    /// The seeds are the valid inputs they claim to be.
    #[test]
    fn seeds_are_valid() {
        let exports = default_exports();
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
        let read = |t: &str, n: &str| std::fs::read(dir.join(t).join(n)).unwrap();
        for n in ["go_default", "go_named_infos", "structured_meta_go", "list_info_go_ro", "export_name_zeroes"] {
            assert!(handshake_input(&read("nbd_handshake", n), &exports).is_some(), "{n} negotiates nothing");
        }
        let neg = handshake_input(&read("nbd_handshake", "structured_meta_go"), &exports).unwrap();
        assert!(neg.structured && neg.contexts.len() == 1 && neg.contexts[0].id == 1);
        assert_eq!(handshake_input(&read("nbd_handshake", "list_info_go_ro"), &exports).unwrap().export, 1);
        assert_eq!(requests_input(&read("nbd_requests", "read_write_flush")), 3);
        assert_eq!(requests_input(&read("nbd_requests", "structured_status")), 4);
        let meta = |n: &str| meta_context_input(&read("meta_context", n), &exports);
        assert_eq!((meta("set_three"), meta("list_all"), meta("set_unstructured")), (Some(3), Some(0), Some(0)));
        for n in ["uml_mkcow_relative", "uml_mkcow_absolute_odd_size"] {
            vdisk_image::cow::parse_header(&read("cow_header", n)).unwrap();
        }
    }

    struct Collect(std::sync::mpsc::Sender<vdisk_engine::Request>);
    impl vdisk_engine::Sink for Collect {
        fn complete(&self, done: Vec<vdisk_engine::Request>) {
            done.into_iter().for_each(|r| self.0.send(r).unwrap());
        }
    }

    /// The fuzzing images hold no files: a FLUSH on them is a no-op that
    /// succeeds (it used to index the first file and panic the worker).
    #[test]
    fn a_flush_of_an_image_without_files_succeeds() {
        let exports = default_exports();
        let (tx, rx) = std::sync::mpsc::channel();
        let sink: Arc<dyn vdisk_engine::Sink> = Arc::new(Collect(tx));
        for e in &exports {
            let flush = vdisk_engine::Request::new(Op::Flush, 0, 0, 7);
            e.device.submit(vec![flush], &sink);
            let done = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the FLUSH completes");
            assert!(done.error.is_none(), "{}: {:?}", e.name, done.error);
            assert!(e.device.failure().is_none(), "{}: {:?}", e.name, e.device.failure());
            e.device.shutdown().unwrap();
        }
    }

    #[test]
    fn nbd_handshake_never_panics() {
        let exports = default_exports();
        replay("nbd_handshake", 5000, &mut |b| {
            handshake_input(b, &exports);
        });
    }

    #[test]
    fn nbd_requests_never_panic() {
        replay("nbd_requests", 5000, &mut |b| {
            requests_input(b);
        });
    }

    #[test]
    fn meta_context_options_never_panic() {
        let exports = default_exports();
        replay("meta_context", 5000, &mut |b| {
            meta_context_input(b, &exports);
        });
    }

    #[test]
    fn cow_header_never_panics() {
        replay("cow_header", 5000, &mut cow_header_input);
    }
}

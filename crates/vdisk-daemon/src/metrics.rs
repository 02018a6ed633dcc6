//! `serve --metrics HOST:PORT`: `GET /metrics` in the OpenMetrics text format,
//! encoded by the `prometheus-client` crate from the engine's own counters at
//! each scrape (nothing is counted twice, and nothing is counted here). Every
//! export's series carry an `export` label; process gauges come from /proc.
//!
//! The HTTP side is the least that Prometheus needs: one scrape at a time, a
//! request line and headers under 8 KiB, the connection closed after the answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use vdisk_engine::stats::{Latency, LATENCY_BOUNDS};
use vdisk_engine::Snapshot;

use crate::daemon::Daemon;
use crate::Error;

/// The metrics endpoint; dropping it stops it.
pub struct MetricsServer {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    pub fn start(addr: SocketAddr, daemon: Arc<Daemon>) -> Result<MetricsServer, Error> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::invalid(format!("cannot serve metrics on {addr}: {e} (pick another --metrics HOST:PORT)"))
        })?;
        Self::serve(listener, daemon)
    }

    /// Serves on `listener`, bound already (by us, or by the service manager).
    pub fn serve(listener: TcpListener, daemon: Arc<Daemon>) -> Result<MetricsServer, Error> {
        let addr = listener.local_addr().map_err(|e| Error::failed("the metrics socket has no address").because(e))?;
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Exports(daemon)));
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                // std's accept retries EINTR itself; a failed accept is skipped.
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Ok(s) = stream {
                        // The scrape's panic edge: one error line, the connection
                        // closed (the scraper sees it at once), the next scrape served.
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(s, &registry))) {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => log::debug!("metrics: {e}"),
                            Err(p) => {
                                let why = p
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| p.downcast_ref::<String>().cloned());
                                log::error!(
                                    "metrics: a scrape panicked: {}; closed it",
                                    why.as_deref().unwrap_or("a panic without a message")
                                );
                            }
                        }
                    }
                }
            })
            .map_err(|e| Error::failed("cannot start the metrics thread").because(e))?;
        Ok(MetricsServer { addr, stopping, thread: Some(thread) })
    }
}

impl MetricsServer {
    /// Where it listens (the port the kernel chose, for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(mut s: TcpStream, registry: &Registry) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            // A stopped and continued process gets EINTR from a read with a timeout.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let line = String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_owned();
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, kind, body) = if method != "GET" {
        ("405 Method Not Allowed", "text/plain", "GET /metrics\n".to_owned())
    } else if path == "/metrics" || path.starts_with("/metrics?") {
        let mut body = String::new();
        prometheus_client::encoding::text::encode(&mut body, registry).map_err(std::io::Error::other)?;
        ("200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", body)
    } else {
        ("404 Not Found", "text/plain", "the metrics are at /metrics\n".to_owned())
    };
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(header.as_bytes())?;
    s.write_all(body.as_bytes())
}

/// Reads every export's counters at scrape time.
#[derive(Debug)]
struct Exports(Arc<Daemon>);

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Daemon")
    }
}

type Labels = Vec<(&'static str, String)>;
/// A label value and how to read its counter from a snapshot.
type Column<'a> = (&'static str, &'a dyn Fn(&Snapshot) -> u64);

/// One metric family: a name, help, type and a value per label set.
fn family<T>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: &[(Labels, T)],
    mut put: impl FnMut(prometheus_client::encoding::MetricEncoder, &T) -> Result<(), std::fmt::Error>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        put(m.encode_family(labels)?, v)?;
    }
    Ok(())
}

fn counter(mut m: prometheus_client::encoding::MetricEncoder, v: &u64) -> Result<(), std::fmt::Error> {
    m.encode_counter::<NoLabelSet, _, u64>(v, None)
}

fn gauge(mut m: prometheus_client::encoding::MetricEncoder, v: &u64) -> Result<(), std::fmt::Error> {
    m.encode_gauge(v)
}

fn histogram(mut m: prometheus_client::encoding::MetricEncoder, l: &&Latency) -> Result<(), std::fmt::Error> {
    let mut buckets: Vec<(f64, u64)> = LATENCY_BOUNDS.iter().copied().zip(l.buckets.iter().copied()).collect();
    // The count per bucket, as the encoder wants it (it sums them up).
    for i in (1..buckets.len()).rev() {
        buckets[i].1 -= buckets[i - 1].1;
    }
    let inf = l.count - l.buckets.last().copied().unwrap_or(0);
    buckets.push((f64::INFINITY, inf));
    m.encode_histogram::<NoLabelSet>(l.sum_us / 1e6, l.count, &buckets, None)
}

impl Collector for Exports {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let devices = self.0.devices();
        let failed: Vec<(Labels, u64)> = devices
            .iter()
            .map(|(name, dev, _)| (vec![("export", name.clone())], u64::from(dev.failure().is_some())))
            .collect();
        let exports: Vec<(String, Snapshot, usize)> =
            devices.into_iter().map(|(name, dev, conns)| (name, dev.stats(), conns)).collect();
        let by = |f: &dyn Fn(&Snapshot, usize) -> u64| -> Vec<(Labels, u64)> {
            exports.iter().map(|(n, s, c)| (vec![("export", n.clone())], f(s, *c))).collect()
        };
        let per_op = |ops: &[Column]| -> Vec<(Labels, u64)> {
            let mut rows = Vec::new();
            for (n, s, _) in &exports {
                rows.extend(ops.iter().map(|(op, f)| (vec![("export", n.clone()), ("op", op.to_string())], f(s))));
            }
            rows
        };
        let requests = per_op(&[
            ("read", &|s| s.read_ops),
            ("write", &|s| s.write_ops),
            ("flush", &|s| s.flush_ops),
            ("trim", &|s| s.trim_ops),
            ("zero", &|s| s.zero_ops),
            ("other", &|s| s.other_ops),
        ]);
        let bytes = per_op(&[("read", &|s| s.read_bytes), ("write", &|s| s.write_bytes)]);
        family(&mut enc, "vdisk_requests", "Requests completed", MetricType::Counter, &requests, counter)?;
        family(&mut enc, "vdisk_bytes", "Bytes read or written", MetricType::Counter, &bytes, counter)?;
        let errors = by(&|s, _| s.errors);
        family(&mut enc, "vdisk_errors", "Requests that failed", MetricType::Counter, &errors, counter)?;
        let in_flight = by(&|s, _| s.in_flight);
        family(&mut enc, "vdisk_in_flight", "Requests in the engine now", MetricType::Gauge, &in_flight, gauge)?;
        let conns = by(&|_, c| c as u64);
        family(&mut enc, "vdisk_connections", "NBD clients connected", MetricType::Gauge, &conns, gauge)?;
        let help = "1 when the export's engine failed and its requests get EIO";
        family(&mut enc, "vdisk_export_failed", help, MetricType::Gauge, &failed, gauge)?;
        let mut lat: Vec<(Labels, &Latency)> = Vec::new();
        for (n, s, _) in &exports {
            for (op, l) in [("read", &s.read_latency), ("write", &s.write_latency), ("flush", &s.flush_latency)] {
                lat.push((vec![("export", n.clone()), ("op", op.to_string())], l));
            }
        }
        let help = "Time from submission to completion in the engine";
        family(&mut enc, "vdisk_request_duration_seconds", help, MetricType::Histogram, &lat, histogram)?;
        jobs(&mut enc, &self.0.jobs())?;
        process(&mut enc, exports.len() as u64)
    }
}

/// The jobs still running or ready (an ended one leaves the metrics; its
/// outcome is `vdisk ctl jobs`'s): bytes done and total, and a state gauge
/// (1 for the state the job is in), labelled by id, type and export.
fn jobs(enc: &mut DescriptorEncoder, jobs: &[crate::jobs::JobInfo]) -> Result<(), std::fmt::Error> {
    use crate::jobs::JobState;
    let live: Vec<_> = jobs.iter().filter(|j| matches!(j.state, JobState::Running | JobState::Ready)).collect();
    let labels = |j: &crate::jobs::JobInfo| -> Labels {
        vec![("id", j.id.to_string()), ("type", j.kind.to_owned()), ("export", j.export.clone())]
    };
    let done: Vec<(Labels, u64)> = live.iter().map(|j| (labels(j), j.done)).collect();
    let total: Vec<(Labels, u64)> = live.iter().map(|j| (labels(j), j.total)).collect();
    let state: Vec<(Labels, u64)> = live
        .iter()
        .map(|j| {
            let mut l = labels(j);
            l.push(("state", j.state.name().to_owned()));
            (l, 1)
        })
        .collect();
    family(enc, "vdisk_job_bytes_done", "Bytes a running job has done", MetricType::Gauge, &done, gauge)?;
    family(enc, "vdisk_job_bytes_total", "Bytes a running job will do in all", MetricType::Gauge, &total, gauge)?;
    let help = "1 for a job that is running or ready, its state in the state label";
    family(enc, "vdisk_job_state", help, MetricType::Gauge, &state, gauge)
}

/// Process gauges from /proc/self: memory, CPU, threads, open files.
fn process(enc: &mut DescriptorEncoder, exports: u64) -> Result<(), std::fmt::Error> {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) close with ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let field = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf only reads its integer argument.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let cpu = (field(11) + field(12)) as f64 / tick.max(1) as f64;
    let rss = field(21) * page.max(1) as u64;
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
    let m = |enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64| -> Result<(), std::fmt::Error> {
        let metric = prometheus_client::metrics::gauge::ConstGauge::new(v);
        metric.encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?)
    };
    m(enc, "vdisk_exports", "Exports served", exports)?;
    m(enc, "process_resident_memory_bytes", "Resident memory", rss)?;
    m(enc, "process_threads", "Threads", field(17))?;
    m(enc, "process_open_fds", "Open file descriptors", fds)?;
    let c = prometheus_client::metrics::counter::ConstCounter::new(cpu);
    c.encode(enc.encode_descriptor("process_cpu_seconds", "User and system CPU time", None, MetricType::Counter)?)
}

//! The command line, as `vdisk --help` teaches it.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use vdisk_daemon::size::parse_size;

#[derive(Parser)]
#[command(
    name = "vdisk",
    version,
    about = "A userspace virtual-disk server: serve disk images over NBD, to VMs (vhost-user-blk) and as FUSE files, in parallel and in batches.",
    after_help = "Examples:
  vdisk create disk.img --size 10G          make a sparse 10 GiB raw image
  vdisk serve disk.img                      serve it on a unix socket (the path is printed)
  vdisk serve disk.img --listen             ...and on TCP 127.0.0.1:10809
  qemu-img info 'nbd+unix:///disk?socket=/run/user/0/vdisk.sock'
  vdisk info disk.img --json
  vdisk create --backing base.img vm1.cow   make a copy-on-write overlay over base.img
  vdisk serve vm1.cow vm2.cow               two overlays over one base, exports \"vm1\" and \"vm2\"
  vdisk commit vm1.cow --into merged.img    write the merged disk to a new raw image
  vdisk serve vm.qcow2                      serve a qcow2 image with its backing chain
  vdisk create --format qcow2 --backing base.img vm2.qcow2   a qcow2 overlay

Run `vdisk COMMAND --help` for the options of each command."
)]
pub struct Cli {
    /// More log output (-v: connections and errors, -vv: debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    pub quiet: bool,
    /// Log lines as text (as `vdisk: warning: ...`) or JSON, one object per line
    /// with time, level, message and, where they apply, export and client.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, value_name = "FORMAT")]
    pub log_format: LogFormat,
    /// The least important log lines shown; overrides -v and -q.
    #[arg(long, value_enum, global = true, value_name = "LEVEL")]
    pub log_level: Option<LogLevel>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(Subcommand)]
pub enum Command {
    /// Create a new disk image (raw, sparse unless --preallocate; or qcow2 with
    /// --format qcow2), or with --backing a copy-on-write overlay over a base
    /// image (UML COW v3, or qcow2 with --format qcow2).
    Create(CreateArgs),
    /// Show an image's format, virtual size and allocated bytes (for an
    /// overlay: its backing file and the sectors it holds).
    Info(InfoArgs),
    /// Merge a COW overlay into its backing file (like `uml_moo -d`), or with
    /// --into into a new raw image (like `uml_moo OVERLAY NEW`); a qcow2
    /// overlay likewise (in place only into a raw backing file).
    #[command(after_help = "Merging into the backing file changes it: every other overlay made over it
becomes invalid, and the overlay's own header no longer matches its mtime (serve
it with --ignore-backing-mtime, or remove it). A backing file or overlay that a
`vdisk serve` has open is refused.

Examples:
  vdisk commit vm1.cow                       write vm1.cow's sectors into its base
  vdisk commit vm1.cow --into vm1-full.img   leave the base alone, write a new image")]
    Commit(CommitArgs),
    /// Serve images as NBD exports until SIGINT or SIGTERM.
    #[command(after_help = "Each IMAGE becomes an export named after its file stem (disk.img → \"disk\");
the empty export name selects the first image, so `nbd+unix:///?socket=PATH` just works.
With no IMAGE, a fresh sparse 1 GiB demo image is served; with --control or
--config and no IMAGE, only what the file names or `vdisk ctl add` adds
(README: Running it as a daemon, Running under systemd).

Durability: writes are acknowledged once in the host page cache; FLUSH makes every
acknowledged write durable (on every connection); FUA writes and --sync writes are
durable before their reply, and still run in parallel.

Examples:
  vdisk serve disk.img
  vdisk serve a.img b.img --socket /tmp/nbd.sock --readonly
  vdisk serve disk.img --listen 0.0.0.0:10809 --workers 32
  vdisk serve vm1.cow vm2.cow               COW overlays (their base opens read-only)
  vdisk serve vm1.cow --backing /new/place/base.img
  vdisk serve --control /run/vdisk.ctl --metrics :9187    a daemon: exports come with `vdisk ctl add`
  vdisk serve --config /etc/vdisk/vdisk.toml --check       validate the file (exit 0 or 2)
  vdisk serve --config /etc/vdisk/vdisk.toml --pid-file /run/vdisk.pid --log-format json
  vdisk serve rbd:rbd/disk --ceph-conf /etc/ceph/ceph.conf   an image on Ceph RBD
  nbdcopy --connections=4 'nbd+unix:///disk?socket=/tmp/nbd.sock' copy.img")]
    Serve(Box<ServeArgs>),
    /// Talk to a running `vdisk serve --control PATH`: add, remove, list exports,
    /// show their statistics, change their QoS limits.
    #[command(
        after_help = "Exit status: 0 done; 1 the server refused (its reason on stderr) or cannot be reached; 2 a usage error.

Examples:
  vdisk serve --control /run/vdisk.ctl --socket /run/vdisk.sock &
  vdisk ctl --control /run/vdisk.ctl add vm1.img --iops 2000
  vdisk ctl --control /run/vdisk.ctl list
  vdisk ctl --control /run/vdisk.ctl stats vm1 --json
  vdisk ctl --control /run/vdisk.ctl qos vm1 --iops 0      lift the limit
  vdisk ctl --control /run/vdisk.ctl remove vm1 --hard
  vdisk ctl --control /run/vdisk.ctl reload                reread the server's --config FILE"
    )]
    Ctl(CtlArgs),
    Soak(vdisk_soak::SoakArgs),
}

#[derive(Args)]
pub struct CreateArgs {
    /// Path of the new image (or rbd:POOL/IMAGE for an image on Ceph RBD); an
    /// existing file or image is never overwritten.
    pub image: PathBuf,
    /// Virtual size: bytes, or with a K, M, G or T suffix (binary units), e.g. 10G.
    /// Required unless --backing is given (an overlay takes its size from BASE;
    /// a qcow2 overlay may be made larger).
    #[arg(long, short, value_parser = parse_size)]
    pub size: Option<u64>,
    /// The new image's format: raw, or qcow2 (version 3, as `qemu-img create -f
    /// qcow2` makes it). Default: raw, or a UML COW overlay with --backing.
    #[arg(long, value_enum)]
    pub format: Option<CreateFormat>,
    /// Cluster size of a new qcow2 image (512 to 2M, a power of two; default 64K).
    #[arg(long, value_parser = parse_size, requires = "format")]
    pub cluster_size: Option<u64>,
    /// Reserve every block now (with a progress bar) instead of leaving the file sparse.
    #[arg(long, conflicts_with = "backing")]
    pub preallocate: bool,
    /// Make IMAGE a copy-on-write overlay over BASE: a UML COW v3 overlay (as
    /// uml_mkcow makes: BASE's absolute path, size and mtime recorded; BASE may
    /// be an RBD snapshot, rbd:POOL/IMAGE@SNAP), or with --format qcow2 a qcow2
    /// overlay (BASE's absolute path and format). BASE is never written.
    #[arg(long, value_name = "BASE")]
    pub backing: Option<PathBuf>,
    #[command(flatten)]
    pub ceph: CephArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum CreateFormat {
    Raw,
    Cow,
    Qcow2,
}

#[derive(Args)]
pub struct CommitArgs {
    /// The COW overlay to merge.
    pub overlay: PathBuf,
    /// Write the merged disk to NEW, a new sparse raw image, and leave the backing file alone.
    #[arg(long, value_name = "NEW")]
    pub into: Option<PathBuf>,
    #[command(flatten)]
    pub backing: BackingArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum TlsArg {
    /// No TLS: STARTTLS is refused.
    Off,
    /// TLS offered; plain clients are served too.
    On,
    /// Only clients that switch to TLS get anything, even the export list.
    Require,
}

/// Who may connect and what they may see.
#[derive(Args, Clone, Default)]
#[command(next_help_heading = "Security")]
pub struct SecurityArgs {
    /// TLS on NBD (NBD_OPT_STARTTLS). Default: require if TLS credentials are given, off otherwise.
    #[arg(long, value_enum, value_name = "MODE")]
    pub tls: Option<TlsArg>,
    /// Directory with server-cert.pem and server-key.pem (and ca-cert.pem for
    /// --tls-verify-peer), the layout of qemu's tls-creds-x509 dir=; or with
    /// keys.psk alone, qemu's tls-creds-psk dir= (then as --tls-psk).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["tls_cert", "tls_key"])]
    pub tls_certificates: Option<PathBuf>,
    /// The server's certificate chain (PEM); with --tls-key, instead of --tls-certificates.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The server's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Ask every TLS client for a certificate signed by the CA (ca-cert.pem in
    /// --tls-certificates, or --tls-ca), like qemu's verify-peer=on.
    #[arg(long)]
    pub tls_verify_peer: bool,
    /// The CA that client certificates must chain to (implies --tls-verify-peer).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// TLS with pre-shared keys instead of certificates: a file of
    /// `username:hexkey` lines (psktool's format, qemu's keys.psk), not readable by others.
    /// Needs a build with the psk feature (`cargo build --release --features psk`).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["tls_certificates", "tls_cert", "tls_verify_peer", "tls_ca"])]
    pub tls_psk: Option<PathBuf>,
    /// Name of each export, once per image in order (default: the file stem).
    #[arg(long, value_name = "NAME")]
    pub export_name: Vec<String>,
    /// Do not tell clients the export names (NBD_OPT_LIST is refused).
    #[arg(long)]
    pub no_list: bool,
    /// Clients must name an export: the empty name no longer selects the first one.
    #[arg(long)]
    pub no_default_export: bool,
    /// Only TLS clients matching PATTERN may open export NAME (repeat for more
    /// patterns or exports); others are told it does not exist and do not see it
    /// listed. PATTERN: `CN=vm-*` (certificate subject: ATTR=GLOB[,ATTR=GLOB]),
    /// or a GLOB matched against the certificate's alternative names
    /// (`*.example.org`) or the PSK username. Needs --tls-verify-peer or --tls-psk.
    #[arg(long, value_name = "NAME=PATTERN")]
    pub export_allow: Vec<String>,
}

/// How to find a COW or qcow2 overlay's backing file.
#[derive(Args, Clone, Default, PartialEq, Eq, Debug)]
pub struct BackingArgs {
    /// The backing file of the COW or qcow2 overlay(s), instead of the path in
    /// the header (for a base that moved). A COW overlay's must still match its size.
    #[arg(long, value_name = "PATH")]
    pub backing: Option<PathBuf>,
    /// Accept a backing file whose modification time differs from the one the
    /// overlay recorded (only if you know its data did not change).
    #[arg(long)]
    pub ignore_backing_mtime: bool,
    #[command(flatten)]
    pub ceph: CephArgs,
}

/// How to reach a Ceph cluster for `rbd:` images (defaults: librados's own
/// lookup, $CEPH_CONF then /etc/ceph/ceph.conf, and client id "admin").
/// `:conf=PATH` and `:id=NAME` in an image name win over these.
#[derive(Args, Clone, Default, PartialEq, Eq, Debug)]
#[command(next_help_heading = "Ceph RBD")]
pub struct CephArgs {
    /// The Ceph configuration file for rbd:POOL/IMAGE names.
    #[arg(long, value_name = "PATH")]
    pub ceph_conf: Option<PathBuf>,
    /// The Ceph client id (as in client.ID) for rbd:POOL/IMAGE names.
    #[arg(long, value_name = "NAME")]
    pub ceph_id: Option<String>,
}

impl CephArgs {
    pub fn options(&self) -> vdisk_image::rbd::ConnectOptions {
        vdisk_image::rbd::ConnectOptions { conf: self.ceph_conf.clone(), id: self.ceph_id.clone(), extra: Vec::new() }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum FormatArg {
    /// qcow2 or a COW overlay if the file starts with their magic, raw otherwise.
    Auto,
    /// Raw, whatever the file starts with (use it for images a guest writes to).
    Raw,
    /// A UML COW v3 overlay.
    Cow,
    /// A qcow2 image (qemu's format, version 2 or 3), with its backing chain.
    Qcow2,
}

#[derive(Args)]
pub struct InfoArgs {
    /// An image file, or rbd:POOL/IMAGE[@SNAP].
    pub image: PathBuf,
    /// Print JSON (keys: path, format, virtual-size, allocated).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub ceph: CephArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum EngineArg {
    Uring,
    Threads,
}

#[derive(Args)]
pub struct ServeArgs {
    /// Images to serve, one export each: files, rbd:POOL/IMAGE[@SNAP] on Ceph
    /// (qemu's spelling, with :conf=PATH:id=NAME; a snapshot is served read-only),
    /// or another server's NBD export (nbd://HOST[:PORT]/NAME,
    /// nbd+unix:///NAME?socket=PATH, nbds://... with libnbd's tls-* parameters).
    pub images: Vec<PathBuf>,
    /// Read server settings and exports from a TOML file (README: Running under
    /// systemd). A flag on the command line wins over the same [server] key;
    /// IMAGEs on the command line are served beside the file's exports.
    /// SIGHUP or `vdisk ctl reload` rereads it and applies the difference.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Only check --config FILE (and the flags with it): exit 0 if it would
    /// start, 2 with the file, line and mistake if not.
    #[arg(long, requires = "config")]
    pub check: bool,
    /// Write the server's pid to PATH once it is ready, and hold a lock on it
    /// (a second server with the same PATH refuses to start); removed at exit.
    #[arg(long, value_name = "PATH")]
    pub pid_file: Option<PathBuf>,
    /// NBD unix socket to listen on (default: $XDG_RUNTIME_DIR or /tmp, vdisk-PID.sock;
    /// none by default when --fuse or --vhost-user-blk is given).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Clients served at once; more are disconnected as they connect, with a
    /// log line [default: 1024].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// Memory all NBD connections together may hold in request and reply
    /// buffers (e.g. 512M, 2G). Past it clients are no longer read until
    /// replies drain; those holding the most unread replies wait first
    /// (docs/design.md: Memory budget) [default: 1/8 of RAM].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_buffer_memory: Option<u64>,
    /// Seconds an NBD client may go without taking any of its replies before it
    /// is disconnected (its writes still complete) [default: 60].
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(1..))]
    pub send_timeout: Option<u32>,
    /// Permissions of the unix sockets, in octal: who may connect (default 0600: the owner only).
    #[arg(long, value_parser = vdisk_daemon::config::parse_mode, value_name = "MODE")]
    pub socket_mode: Option<u32>,
    /// Control socket (unix, JSON-RPC 2.0, one object per line; docs/control.md):
    /// add, remove and inspect exports while serving, with `vdisk ctl`. With it
    /// and no IMAGE the server starts with no exports. Made with --control-mode.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Permissions of the control socket, in octal (default 0600; --socket-mode
    /// never applies to it). Group or other access needs --image-root.
    #[arg(long, value_parser = vdisk_daemon::config::parse_mode, value_name = "MODE")]
    pub control_mode: Option<u32>,
    /// The control socket's group: its members may change exports, like the
    /// server's own user (with --control-mode 0660, only they may connect).
    #[arg(long, value_name = "GROUP")]
    pub control_group: Option<String>,
    /// A directory beneath which every image (and backing file, FUSE file,
    /// vhost-user socket) that the control socket or the config file adds must
    /// lie; repeatable. IMAGEs on the command line are not restricted.
    #[arg(long = "image-root", value_name = "DIR")]
    pub image_roots: Vec<PathBuf>,
    /// Seconds a control request may take before it fails with an error,
    /// leaving nothing half added (default 30).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(1..=86400))]
    pub control_timeout: Option<u32>,
    /// Serve Prometheus metrics (per-export counters and latency histograms) at
    /// http://HOST:PORT/metrics; HOST:PORT, :PORT or PORT (host 127.0.0.1).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics: Option<String>,
    /// Also (or only, without --socket) listen on TCP; HOST:PORT, :PORT or PORT. Default 127.0.0.1:10809.
    #[arg(long, num_args = 0..=1, default_missing_value = "127.0.0.1:10809", value_name = "HOST:PORT")]
    pub listen: Option<String>,
    /// Serve the image as a regular file at PATH through FUSE (created if
    /// missing; `losetup` turns it into a block device). Once per image, in
    /// order; with --socket or --listen, NBD serves the same device too.
    #[arg(long, value_name = "PATH")]
    pub fuse: Vec<PathBuf>,
    /// Use FUSE-over-io_uring for --fuse (Linux 6.14+, enable_uring=Y) instead of /dev/fuse reads.
    #[arg(long, requires = "fuse")]
    pub fuse_uring: bool,
    /// Serve the image to a VM as a vhost-user-blk backend on the unix socket
    /// SOCKET (QEMU: -chardev socket,path=SOCKET -device vhost-user-blk-pci; guest
    /// memory must be shared). Once per image, in order; combines with the others.
    #[arg(long, value_name = "SOCKET")]
    pub vhost_user_blk: Vec<PathBuf>,
    /// Virtqueues offered to the VM for --vhost-user-blk (default: one per CPU).
    #[arg(long, value_name = "N", requires = "vhost_user_blk", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub num_queues: Option<u16>,
    /// How long SIGTERM/SIGINT may take to finish requests, flush and stop
    /// (30s, 500ms, 2m; default 30s). Past it, what could not be flushed is
    /// logged by export and vdisk exits with status 3 without waiting for
    /// storage that does not answer; a second signal gives up at once.
    #[arg(long, value_name = "DURATION", value_parser = vdisk_daemon::stopping::parse_duration)]
    pub stop_timeout: Option<std::time::Duration>,
    /// Refuse every write, trim and zero.
    #[arg(long)]
    pub readonly: bool,
    /// The I/O engine: uring (batches in one io_uring_enter; falls back to threads
    /// with a log line where the kernel lacks it) or threads (a pool of workers). Default: uring.
    #[arg(long, value_enum)]
    pub engine: Option<EngineArg>,
    /// Most threads of the shared pool serving one export at once (thread engine; at most half the pool).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub workers: u16,
    /// Unused since every device shares the I/O core's rings (see --io-threads); kept for old command lines.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub rings: u16,
    /// I/O core threads, each with one io_uring, shared by every export (uring engine), and 8 times as
    /// many blocking workers in the thread engine's shared pool. Default: one per CPU (the pool: at least 16).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub io_threads: Option<u16>,
    /// Let a kernel thread poll each ring's submission queue (uring engine; costs a core while busy).
    #[arg(long)]
    pub sqpoll: bool,
    /// Most requests handed over at once on every hop; 1 turns batching and
    /// request merging off (to measure what they are worth).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub batch: u16,
    /// Never finish requests in the connection's own thread (by default, I/O that
    /// cannot wait for a device — in-memory files, page-cache hits — runs inline).
    #[arg(long)]
    pub no_inline: bool,
    /// Bypass the host page cache (O_DIRECT, like qemu's cache=none) for aligned
    /// requests; unaligned ones still go through the cache. Not on tmpfs.
    #[arg(long)]
    pub direct: bool,
    /// Make every write durable before its reply (writes still run in parallel).
    #[arg(long)]
    pub sync: bool,
    /// Image format. Auto-detection trusts the first bytes of the file: serve
    /// raw images a guest can write with --format raw.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    pub format: FormatArg,
    #[command(flatten)]
    pub backing: BackingArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
}

impl ServeArgs {
    /// The permissions of every unix socket the server makes.
    pub fn socket_mode(&self) -> u32 {
        self.socket_mode.unwrap_or(0o600)
    }
}

#[derive(Args)]
pub struct CtlArgs {
    /// The server's control socket (`vdisk serve --control PATH`); default: $VDISK_CONTROL.
    #[arg(long, global = true, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Print the server's answer as JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// QoS limits; 0 lifts one. Bytes/s take K, M, G suffixes.
#[derive(Args, Clone, Default)]
pub struct QosArgs {
    /// Requests per second.
    #[arg(long, value_name = "N")]
    pub iops: Option<u64>,
    /// Bytes per second, reads and writes together.
    #[arg(long, value_name = "N", value_parser = parse_size)]
    pub bps: Option<u64>,
    /// Bytes read per second.
    #[arg(long, value_name = "N", value_parser = parse_size)]
    pub read_bps: Option<u64>,
    /// Bytes written per second.
    #[arg(long, value_name = "N", value_parser = parse_size)]
    pub write_bps: Option<u64>,
}

#[derive(Subcommand)]
pub enum CtlCommand {
    /// Serve one more image (the same checks as at start; nothing is left half-started on failure).
    Add {
        /// The image: a file (made absolute here, so the server finds it whatever
        /// its directory), rbd:POOL/IMAGE or an NBD URI, as for `vdisk serve`.
        image: PathBuf,
        /// Export name (default: the image's file stem); a name in use is refused.
        #[arg(long)]
        name: Option<String>,
        /// Refuse every write, trim and zero.
        #[arg(long)]
        readonly: bool,
        #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
        format: FormatArg,
        #[command(flatten)]
        backing: BackingArgs,
        /// Also serve it as a regular file at PATH through FUSE.
        #[arg(long, value_name = "PATH")]
        fuse: Option<PathBuf>,
        /// Also serve it to a VM on this vhost-user-blk socket.
        #[arg(long, value_name = "SOCKET")]
        vhost_user_blk: Option<PathBuf>,
        /// Virtqueues for --vhost-user-blk (default: one per CPU).
        #[arg(long, value_name = "N", requires = "vhost_user_blk", value_parser = clap::value_parser!(u16).range(1..=64))]
        num_queues: Option<u16>,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Stop serving an export; refused while clients are attached, unless --hard.
    Remove {
        name: String,
        /// Finish what is in flight, flush, disconnect NBD clients, unmount the
        /// FUSE file, disconnect the VM, close the image.
        #[arg(long)]
        hard: bool,
    },
    /// The exports served.
    List,
    /// Requests, bytes, errors and latency of one export, or of all.
    Stats { name: Option<String> },
    /// Change an export's QoS limits, live.
    Qos {
        name: String,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// The server's version, uptime and totals.
    Info,
    /// Reread the server's --config FILE and apply the difference (as SIGHUP does).
    Reload,
    /// An export's dirty bitmaps (incremental backup): add, remove, clear, enable, disable, merge, list.
    #[command(subcommand)]
    Bitmap(crate::ctl_verbs::BitmapCommand),
    /// Make a new overlay the export's top, live: the current top becomes its read-only backing.
    Snapshot {
        name: String,
        /// The new overlay (must not exist).
        #[arg(long, value_name = "PATH", required_unless_present = "rbd_snap")]
        overlay: Option<PathBuf>,
        /// For an RBD export: make the RBD snapshot NAME of its image instead (the export serves on).
        #[arg(long, value_name = "NAME", conflicts_with_all = ["overlay", "format"])]
        rbd_snap: Option<String>,
        #[arg(long, value_enum, default_value_t = OverlayFormatArg::Qcow2)]
        format: OverlayFormatArg,
    },
    /// Copy what the backing files hold into the export's qcow2 top, live, then drop them from its chain (a job).
    Stream {
        name: String,
        #[command(flatten)]
        job: JobArgs,
    },
    /// Merge layers of the export's chain into a lower one, live (a job): the layers from --top down to
    /// just above --base are copied into --base, then the layer above --top backs onto --base.
    Commit {
        name: String,
        /// The highest layer merged (default: the layer just below the live top; the live top itself is an
        /// active commit).
        #[arg(long, value_name = "FILE")]
        top: Option<PathBuf>,
        /// The layer merged into (default: the bottom of the chain).
        #[arg(long, value_name = "FILE")]
        base: Option<PathBuf>,
        /// Remove the dropped layers' files once the new chain serves.
        #[arg(long)]
        delete: bool,
        /// Commit the live top itself (an active commit: its data is mirrored into --base while the guest
        /// writes, then the export serves from --base).
        #[arg(long, conflicts_with = "top")]
        active: bool,
        #[command(flatten)]
        job: JobArgs,
    },
    /// The live disk operations (snapshot, stream, commit, mirror), running and ended.
    Jobs,
    /// Stop a running job; its export serves as before the job.
    Cancel { job: u64 },
    /// Switch a ready mirror or active commit's export to what it made.
    Pivot { job: u64 },
    /// Copy the export, live, to a new raw or qcow2 file, an NBD export or an RBD image; with --pivot, serve
    /// from it once the copy has caught up.
    Mirror {
        name: String,
        /// The target: a new file's path, nbd://HOST[:PORT]/NAME, nbd+unix:///NAME?socket=PATH (nbds://,
        /// nbds+unix:// over TLS, with ?tls-certificates=DIR or USER@ and ?tls-psk-file=FILE, as libnbd), or
        /// rbd:POOL/IMAGE[:conf=PATH][:id=NAME] (made at the export's size).
        #[arg(long, value_name = "TARGET")]
        to: String,
        /// The new file's format.
        #[arg(long, value_enum, default_value_t = MirrorFormatArg::Raw)]
        format: MirrorFormatArg,
        /// Switch the export to the target as soon as the job is ready.
        #[arg(long)]
        pivot: bool,
        /// Write into an existing file of the export's size (an existing RBD image at least that large)
        /// instead of a new one.
        #[arg(long)]
        existing: bool,
        #[command(flatten)]
        job: JobArgs,
    },
    /// Point-in-time backup views of an export (begin, end, list), for full and incremental backups over NBD.
    #[command(subcommand)]
    Backup(crate::ctl_verbs::BackupCommand),
}

/// How a job runs: its own I/O limit, and whether `vdisk ctl` waits for it.
#[derive(Args, Clone, Default)]
pub struct JobArgs {
    /// The job's own I/O limit in bytes per second (10M, 1G), so it does not starve the guest.
    #[arg(long, value_name = "RATE", value_parser = parse_size)]
    pub bps: Option<u64>,
    /// Wait for the job to end, showing its progress; exit 0 when done, 1 when it failed or was cancelled.
    #[arg(long)]
    pub wait: bool,
}

/// The format of a mirror's new file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MirrorFormatArg {
    Raw,
    Qcow2,
}

/// The format of a snapshot's overlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OverlayFormatArg {
    Qcow2,
    Cow,
}

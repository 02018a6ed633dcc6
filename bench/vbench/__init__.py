"""vbench: the pieces of bench/run.py, the vdisk benchmark suite.

common    paths, logging, shell helpers, the cleanup stack, CPU pinning, the images
servers   starting and stopping vdisk, qemu-nbd and nbdkit; CPU time and peak RSS; the vdisk binary
fio       the fio job matrix, running fio and parsing its JSON (section "fio")
ablations vdisk knobs and system calls per request (section "ablations")
loopdev   nbdfuse + loop device experiments: dd, mkfs, find|cat, dbench, aio-stress (section "loop")
overlay   copy-on-write overlays (COW v3, qcow2, nbdkit's cow filter) over a tmpfs base (section "overlay")
vm        a QEMU guest on vhost-user-blk: vdisk vs qemu-storage-daemon (section "vm")
rbd       a throwaway Ceph cluster: vdisk, qemu-nbd's rbd driver, fio's rbd engine (section "rbd")
scale     many exports on one server: RSS, threads, adds, busy beside idle, fairness (section "scale")
jobs      guest IOPS during a mirror and an active commit, vdisk vs qemu-storage-daemon (section "jobs")
report    docs/benchmarks.md and docs/benchmarks.png from the results
"""

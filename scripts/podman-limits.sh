# Sourced by scripts/build-image.sh and scripts/build-rehearsal-image.sh: the rlimit flags
# every podman command needs on these machines. Raising a limit above this shell's is
# refused (nproc: podman's default 32768 at most; this shell's own nproc is refused too),
# so pass the shell's own, capped.
limits() {
    local n p
    n=$(ulimit -n)
    p=$(ulimit -u)
    [[ $n == unlimited || $n -gt 1048576 ]] && n=1048576
    [[ $p == unlimited || $p -gt 32768 ]] && p=32768
    echo "--ulimit nofile=$n:$n --ulimit nproc=$p:$p"
}

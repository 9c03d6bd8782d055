//go:build !race

package etcdtest

// parallel is Parallel without the race detector.
const parallel = 16

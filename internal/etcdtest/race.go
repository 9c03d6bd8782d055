//go:build race

package etcdtest

// parallel is Parallel under the race detector.
const parallel = 8

package etcdtest

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"testing"

	"go.uber.org/goleak"
)

// Parallel is how many tests of a package run at once (t.Parallel) unless
// -parallel says otherwise: tests against etcd wait on leases, watches and
// faults far more than they compute, so more of them than the machine has
// cores run side by side: 16 (norace.go; tests/ in -short uses about a
// quarter of two cores at 12, and its time is mostly tests waiting for a
// slot), and 8 under the race detector (race.go), whose checks
// multiply the CPU each test needs.
const Parallel = parallel

// DefaultParallel sets -test.parallel to Parallel unless the command line
// set it. A TestMain calls it before m.Run; it parses the flags.
func DefaultParallel() error {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if set {
		return nil
	}
	if err := flag.Set("test.parallel", strconv.Itoa(Parallel)); err != nil {
		return fmt.Errorf("etcdtest: set -test.parallel: %w", err)
	}
	return nil
}

// Main is a package's TestMain: DefaultParallel, then the tests, then
// goleak's check that no goroutine outlives them but the ignored ones (the
// embedded members' own). It exits the process with the tests' status, or
// 2 when the flags cannot be set.
func Main(m *testing.M, ignored ...goleak.Option) {
	if err := DefaultParallel(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	goleak.VerifyTestMain(m, ignored...)
}

package etcdsync_test

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"go.uber.org/goleak"
)

// parallelTests is how many tests run at once unless -parallel says
// otherwise: the tests wait on etcd (leases, watches, faults) far more than
// they compute, so more of them than the machine has cores run side by side.
const parallelTests = 8

// The goroutines embedded members leave for the life of the process are
// not leaks.
func TestMain(m *testing.M) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		if err := flag.Set("test.parallel", strconv.Itoa(parallelTests)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	goleak.VerifyTestMain(m, etcdsynctest.IgnoredGoroutines()...)
}

package etcdsync_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"go.uber.org/goleak"
)

// Tests run 8 at a time unless -parallel says otherwise (see
// etcdtest.DefaultParallel). The goroutines embedded members leave for the
// life of the process are not leaks.
func TestMain(m *testing.M) {
	if err := etcdtest.DefaultParallel(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	goleak.VerifyTestMain(m, etcdsynctest.IgnoredGoroutines()...)
}

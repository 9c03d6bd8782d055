package etcdsync_test

import (
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"go.uber.org/goleak"
)

// The goroutines embedded members leave for the life of the process are
// not leaks.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, etcdsynctest.IgnoredGoroutines()...)
}

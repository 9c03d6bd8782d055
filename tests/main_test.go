package tests

import (
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// Tests run 8 at a time unless -parallel says otherwise (see
// etcdtest.DefaultParallel). The goroutines embedded members leave for the
// life of the process are not leaks.
func TestMain(m *testing.M) { etcdtest.Main(m, etcdsynctest.IgnoredGoroutines()...) }

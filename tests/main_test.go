package tests

import (
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// Tests run 16 at a time (8 with -race) unless -parallel says otherwise (see
// etcdtest.DefaultParallel). The goroutines embedded members leave for the
// life of the process are not leaks.
func TestMain(m *testing.M) { etcdtest.Main(m, etcdsynctest.IgnoredGoroutines()...) }

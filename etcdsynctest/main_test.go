package etcdsynctest_test

import (
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// Tests run 16 at a time (8 with -race) unless -parallel says otherwise (see
// etcdtest.DefaultParallel).
func TestMain(m *testing.M) { etcdtest.Main(m, etcdsynctest.IgnoredGoroutines()...) }

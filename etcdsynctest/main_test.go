package etcdsynctest_test

import (
	"testing"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, etcdsynctest.IgnoredGoroutines()...)
}

package etcdtest

import (
	"fmt"
	"os"
	"testing"
)

// The cluster tests run side by side, as many as DefaultParallel says; those
// that look at the process's goroutines are not parallel, and run first.
func TestMain(m *testing.M) {
	if err := DefaultParallel(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

//go:build unix

package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// etcd's client logs only its errors: an unreachable etcd is lockctl's one
// line, without the client's "retrying of unary invoker failed" warnings,
// which --debug restores.
func TestClientWarningsOnlyWithDebug(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	code, p := run(t, "--endpoints", "127.0.0.1:1", "--dial-timeout", "1s", "run", name, "--", "true")
	require.Equal(t, exitFailure, code)
	require.Contains(t, oneLine(t, p.stderr.String()), "etcd at 127.0.0.1:1")

	code, p = run(t, "--debug", "--endpoints", "127.0.0.1:1", "--dial-timeout", "1s", "run", name, "--", "true")
	require.Equal(t, exitFailure, code)
	require.Contains(t, p.stderr.String(), "retrying of unary invoker failed")
	require.Contains(t, p.stderr.String(), "lockctl: etcd at 127.0.0.1:1")
}

//go:build unix

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// holdersOf runs "lockctl holders NAME -o json" and parses its output.
func holdersOf(t *testing.T, name string) []entry {
	t.Helper()
	code, p := run(t, "holders", "-o", "json", name)
	require.Equal(t, 0, code, "stderr: %s", p.stderr.String())
	var got []entry
	require.NoError(t, json.Unmarshal([]byte(p.stdout.String()), &got), "%s", p.stdout.String())
	return got
}

// want is an expected row: role, kind and value; the rest comes from the
// keys in etcd.
type want struct{ role, kind, value string }

// labelled is the value of a lock that lockctl run holds: who holds it.
const labelled = "lockctl host=<host> pid=<pid>"

// checkHolders checks rows against the keys kvs (in queue order) and want.
func checkHolders(t *testing.T, got []entry, kvs []*mvccpb.KeyValue, positions []int, wants []want) {
	t.Helper()
	require.Len(t, got, len(wants), "%+v", got)
	for i, e := range got {
		kv := kvs[i]
		require.Equal(t, positions[i], e.Position, "row %d", i)
		require.Equal(t, wants[i].role, e.Role, "row %d: %+v", i, e)
		require.Equal(t, wants[i].kind, e.Kind, "row %d", i)
		if wants[i].value == labelled {
			require.Regexp(t, `^lockctl host=\S+ pid=[0-9]+$`, e.Value, "row %d", i)
		} else {
			require.Equal(t, wants[i].value, e.Value, "row %d", i)
		}
		require.Equal(t, string(kv.Key), e.Key, "row %d", i)
		require.Equal(t, kv.CreateRevision, e.CreateRevision, "row %d", i)
		require.Equal(t, strconv.FormatInt(kv.Lease, 16), e.Lease, "row %d", i)
		require.True(t, strings.HasSuffix(e.Key, "/"+e.Lease), "row %d: the key ends with its lease", i)
		require.True(t, e.TTL > 0 && e.TTL <= 12, "row %d: TTL %d (10 s and a slack of 2 s)", i, e.TTL)
	}
}

// startHolding starts lockctl runs one after another, each once the
// previous one's key exists, so that the queue order is known; their
// commands wait for release.
func startHolding(t *testing.T, name, release string, runs ...[]string) {
	t.Helper()
	for i, flags := range runs {
		args := append(append([]string{"run"}, flags...), name, "--", "sh", "-c", waitFor(release))
		start(t, args...)
		waitKeys(t, name+"/", i+1)
	}
}

func TestHolders(t *testing.T) {
	t.Parallel()
	t.Run("mutex", func(t *testing.T) {
		t.Parallel()
		name, dir := uniqueName(t), t.TempDir()
		release := filepath.Join(dir, "release")
		startHolding(t, name, release, nil, nil, nil)
		kvs := keys(t, name+"/")
		// Keys that are not in the queue: a nested name's, a non-ID child.
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		for _, k := range []string{name + "/x/1f", name + "/zz"} {
			_, err := admin.Put(ctx, k, "")
			require.NoError(t, err)
			defer admin.Delete(context.Background(), k)
		}
		got := holdersOf(t, name)
		checkHolders(t, got, kvs, []int{1, 2, 3}, []want{{"holder", "exclusive", labelled}, {"waiter", "exclusive", ""}, {"waiter", "exclusive", ""}})

		code, p := run(t, "holders", name)
		require.Equal(t, 0, code)
		lines := strings.Split(strings.TrimSpace(p.stdout.String()), "\n")
		require.Len(t, lines, 4, "%s", p.stdout.String())
		require.Equal(t, []string{"POS", "ROLE", "KIND", "KEY", "REV", "LEASE", "TTL", "VALUE"}, strings.Fields(lines[0]))
		for i, line := range lines[1:] {
			f := strings.Fields(line)
			require.Equal(t, []string{strconv.Itoa(i + 1), got[i].Role, "exclusive", got[i].Key, strconv.FormatInt(got[i].CreateRevision, 10), got[i].Lease}, f[:6])
			require.True(t, strings.HasSuffix(line, strconv.Quote(got[i].Value)), "row %d: %s", i, line)
		}
		touch(t, release)
	})
	t.Run("rwmutex", func(t *testing.T) {
		t.Parallel()
		name, dir := uniqueName(t), t.TempDir()
		release := filepath.Join(dir, "release")
		startHolding(t, name, release, []string{"--read"}, []string{"--read"}, []string{"--write"}, []string{"--read"})
		kvs := keys(t, name+"/")
		checkHolders(t, holdersOf(t, name), kvs, []int{1, 2, 3, 4}, []want{{"holder", "read", labelled}, {"holder", "read", labelled}, {"waiter", "write", ""}, {"waiter", "read", ""}})
		touch(t, release)
	})
	t.Run("semaphore", func(t *testing.T) {
		t.Parallel()
		name, dir := uniqueName(t), t.TempDir()
		release := filepath.Join(dir, "release")
		sem := func(n int) []string { return []string{"--sem", "3", "--permits", strconv.Itoa(n)} }
		startHolding(t, name, release, sem(2), sem(1), sem(1), sem(1))
		kvs := keys(t, name+"/")
		checkHolders(t, holdersOf(t, name), kvs, []int{1, 2, 3, 4}, []want{{"holder", "semaphore", "2/3"}, {"holder", "semaphore", "1/3"}, {"waiter", "semaphore", "1/3"}, {"waiter", "semaphore", "1/3"}})
		touch(t, release)
	})
	t.Run("election", func(t *testing.T) {
		t.Parallel()
		name := uniqueName(t)
		start(t, "elect", name, "a")
		waitKeys(t, name+"/", 1)
		start(t, "elect", name, "b b")
		kvs := waitKeys(t, name+"/", 2)
		checkHolders(t, holdersOf(t, name), kvs, []int{1, 2}, []want{{"holder", "exclusive", "a"}, {"waiter", "exclusive", "b b"}})
	})
	t.Run("empty", func(t *testing.T) {
		t.Parallel()
		name := uniqueName(t)
		code, p := run(t, "holders", "-o", "json", name)
		require.Equal(t, 0, code)
		require.Equal(t, "[]\n", p.stdout.String())
		code, p = run(t, "holders", name)
		require.Equal(t, 0, code)
		require.Equal(t, []string{"POS", "ROLE", "KIND", "KEY", "REV", "LEASE", "TTL", "VALUE"}, strings.Fields(p.stdout.String()))
	})
}

// Bad input: one line on stderr, a documented exit code, at once, and
// nothing in etcd; the command never runs.
func TestBadInput(t *testing.T) {
	t.Parallel()
	unreachable := []string{"--endpoints", "127.0.0.1:1", "--dial-timeout", "1s"}
	for _, tc := range []struct {
		name string
		args []string
		env  []string
		code int
		says string
	}{
		{"unknown flag", []string{"run", "--bogus", "N", "--", "CMD"}, nil, exitUsage, "unknown flag: --bogus"},
		{"unknown root flag", []string{"--bogus", "holders", "N"}, nil, exitUsage, "unknown flag: --bogus"},
		{"shell words without --", []string{"run", "N", "sh", "-c", "CMD"}, nil, exitUsage, "unknown shorthand flag"},
		{"missing --", []string{"run", "N", "CMD"}, nil, exitUsage, "missing -- before the command"},
		{"missing command", []string{"run", "N"}, nil, exitUsage, "missing -- before the command"},
		{"nothing after --", []string{"run", "N", "--"}, nil, exitUsage, "no command after --"},
		{"two names with --read", []string{"run", "--read", "N", "M", "--", "CMD"}, nil, exitUsage, "--read, --write and --sem take one name"},
		{"two names with --sem", []string{"run", "--sem", "2", "N", "M", "--", "CMD"}, nil, exitUsage, "take one name"},
		{"an empty name of two", []string{"run", "N", "", "--", "CMD"}, nil, exitUsage, "name is empty"},
		{"elect three", []string{"elect", "N", "v", "w", "--", "CMD"}, nil, exitUsage, "want NAME VALUE"},
		{"empty name", []string{"run", "", "--", "CMD"}, nil, exitUsage, "name is empty"},
		{"empty name elect", []string{"elect", "", "v", "--", "CMD"}, nil, exitUsage, "name is empty"},
		{"empty name observe", []string{"observe", ""}, nil, exitUsage, "name is empty"},
		{"empty name holders", []string{"holders", ""}, nil, exitUsage, "name is empty"},
		{"elect missing --", []string{"elect", "N", "v", "CMD"}, nil, exitUsage, "missing -- before the command"},
		{"elect no value", []string{"elect", "N"}, nil, exitUsage, "want NAME VALUE"},
		{"bad --sem", []string{"run", "--sem", "0", "N", "--", "CMD"}, nil, exitUsage, "--sem 0"},
		{"--sem not a number", []string{"run", "--sem", "two", "N", "--", "CMD"}, nil, exitUsage, "--sem"},
		{"--permits over --sem", []string{"run", "--sem", "2", "--permits", "3", "N", "--", "CMD"}, nil, exitUsage, "--permits 3"},
		{"--permits without --sem", []string{"run", "--permits", "2", "N", "--", "CMD"}, nil, exitUsage, "--permits needs --sem"},
		{"--read and --write", []string{"run", "--read", "--write", "N", "--", "CMD"}, nil, exitUsage, "exclude each other"},
		{"--read and --sem", []string{"run", "--read", "--sem", "2", "N", "--", "CMD"}, nil, exitUsage, "exclude each other"},
		{"--try and --timeout", []string{"run", "--try", "--timeout", "1s", "N", "--", "CMD"}, nil, exitUsage, "exclude each other"},
		{"--ttl below 1s", []string{"run", "--ttl", "500ms", "N", "--", "CMD"}, nil, exitUsage, "--ttl"},
		{"unknown command", []string{"lock", "N"}, nil, exitUsage, `unknown command "lock"`},
		{"no command", nil, nil, exitUsage, "missing command"},
		{"bad -o", []string{"holders", "-o", "yaml", "N"}, nil, exitUsage, "yaml"},
		{"bad environment", []string{"holders", "N"}, []string{"ETCDCTL_DIAL_TIMEOUT=soon"}, exitUsage, "ETCDCTL_DIAL_TIMEOUT"},
		{"user without password", []string{"--user", "bob", "holders", "N"}, nil, exitUsage, "--user needs a password"},
		{"cert without key", []string{"--cert", "c.pem", "holders", "N"}, nil, exitUsage, "--cert and --key"},
		{"unreachable run", append(unreachable, "run", "N", "--", "CMD"), nil, exitFailure, "127.0.0.1:1"},
		{"unreachable elect", append(unreachable, "elect", "N", "v", "--", "CMD"), nil, exitFailure, "127.0.0.1:1"},
		{"unreachable observe", append(unreachable, "observe", "N"), nil, exitFailure, "127.0.0.1:1"},
		{"unreachable holders", []string{"holders", "N"}, []string{"ETCDCTL_ENDPOINTS=127.0.0.1:1", "ETCDCTL_DIAL_TIMEOUT=1s"}, exitFailure, "connection refused"},
		{"empty name members", []string{"members", ""}, nil, exitUsage, "name is empty"},
		{"members two names", []string{"members", "N", "M"}, nil, exitUsage, "want NAME"},
		{"bad -o members", []string{"members", "-o", "yaml", "N"}, nil, exitUsage, "yaml"},
		{"unreachable members", append(unreachable, "members", "N"), nil, exitFailure, "127.0.0.1:1"},
		{"unreachable members --watch", append(unreachable, "members", "--watch", "N"), nil, exitFailure, "127.0.0.1:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			name, dir := uniqueName(t), t.TempDir()
			marker := filepath.Join(dir, "ran")
			var args []string
			for _, a := range tc.args {
				switch a {
				case "N":
					args = append(args, name)
				case "CMD":
					args = append(args, "touch", marker)
				default:
					args = append(args, a)
				}
			}
			p := startWith(t, opts{env: tc.env}, args...)
			code := p.wait(t)
			require.Less(t, p.ended.Sub(p.started), 5*time.Second, "not at once")
			require.Equal(t, tc.code, code, "stderr: %s", p.stderr.String())
			line := oneLine(t, p.stderr.String())
			t.Log(line)
			require.Contains(t, line, tc.says)
			require.Empty(t, p.stdout.String())
			require.NoFileExists(t, marker)
			noKeys(t, name)
		})
	}
}

// The lock of a running "lockctl run" says who holds it: lockctl's host and
// pid, as its key's value, which holders shows.
func TestRunWritesWhoHolds(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	p, release := holding(t, dir, "run", name)
	got := holdersOf(t, name)
	require.Len(t, got, 1)
	host, err := os.Hostname()
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("lockctl host=%s pid=%d", host, p.cmd.Process.Pid), got[0].Value)
	require.Equal(t, "holder", got[0].Role)
	touch(t, release)
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
}

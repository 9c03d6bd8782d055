//go:build unix

package main

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// joinGroup makes a new session of admin a member of name with val; the
// session is closed in t's cleanup.
func joinGroup(t *testing.T, name, val string) *etcdsync.Session {
	t.Helper()
	s, err := etcdsync.NewSession(admin)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	require.NoError(t, etcdsync.NewGroup(s, name).Join(ctx, val))
	return s
}

// checkView checks that v shows exactly name's direct children NAME/<id>
// at v's revision, in join order, with values want.
func checkView(t *testing.T, name string, v view, want ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithRev(v.Revision), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	require.NoError(t, err)
	var kvs []member
	for _, kv := range resp.Kvs {
		if rest := strings.TrimPrefix(string(kv.Key), name+"/"); !strings.Contains(rest, "/") && rest != "zz" {
			kvs = append(kvs, member{Position: len(kvs) + 1, Key: string(kv.Key), CreateRevision: kv.CreateRevision, Lease: strconv.FormatInt(kv.Lease, 16), Value: string(kv.Value)})
		}
	}
	require.Equal(t, len(want), len(kvs), "members at %d: %+v", v.Revision, kvs)
	require.Equal(t, kvs, v.Members)
	for i, m := range v.Members {
		require.Equal(t, want[i], m.Value)
	}
}

// members prints a Group's members at one revision, in join order; keys of
// nested names and non-ID children are not members.
func TestMembers(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	joinGroup(t, name, "a")
	joinGroup(t, name+"/x", "nested")
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	_, err := admin.Put(ctx, name+"/zz", "not an ID")
	require.NoError(t, err)
	joinGroup(t, name, "b b")

	code, p := run(t, "members", "-o", "json", name)
	require.Equal(t, 0, code, "stderr: %s", p.stderr.String())
	var v view
	require.NoError(t, json.Unmarshal([]byte(p.stdout.String()), &v), "%s", p.stdout.String())
	require.Nil(t, v.Resynced)
	checkView(t, name, v, "a", "b b")

	code, p = run(t, "members", name)
	require.Equal(t, 0, code)
	lines := strings.Split(strings.TrimSpace(p.stdout.String()), "\n")
	require.Len(t, lines, 3, "%s", p.stdout.String())
	require.Equal(t, []string{"POS", "KEY", "REV", "LEASE", "VALUE"}, strings.Fields(lines[0]))
	for i, line := range lines[1:] {
		m := v.Members[i]
		require.Equal(t, []string{strconv.Itoa(i + 1), m.Key, strconv.FormatInt(m.CreateRevision, 10), m.Lease}, strings.Fields(line)[:4])
		require.True(t, strings.HasSuffix(line, strconv.Quote(m.Value)), "row %d: %s", i, line)
	}

	empty := name + "-empty"
	code, p = run(t, "members", "-o", "json", empty)
	require.Equal(t, 0, code)
	require.NoError(t, json.Unmarshal([]byte(p.stdout.String()), &v))
	require.Equal(t, []member{}, v.Members)
	require.Contains(t, p.stdout.String(), `"members": []`)
}

// members --watch prints the members, then a view after each change, each
// exact at its revision, until SIGTERM (exit 0).
func TestMembersWatch(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	joinGroup(t, name, "a")
	w := start(t, "members", "--watch", "-o", "json", name)
	tw := start(t, "members", "--watch", name)
	views := func() []view {
		var out []view
		for _, line := range strings.Split(strings.TrimSpace(w.stdout.String()), "\n") {
			if line == "" {
				continue
			}
			var v view
			require.NoError(t, json.Unmarshal([]byte(line), &v), "%q", line)
			out = append(out, v)
		}
		return out
	}
	last := func(n int) view {
		t.Helper()
		var vs []view
		eventually(t, func() bool { vs = views(); return len(vs) > 0 && len(vs[len(vs)-1].Members) == n }, "a view of %d members, have %+v", n, vs)
		return vs[len(vs)-1]
	}
	checkView(t, name, last(1), "a")
	tables := func() int { return strings.Count(tw.stdout.String(), "revision ") }
	eventually(t, func() bool { return tables() == 1 }, "a view in a table, have %q", tw.stdout.String())
	b := joinGroup(t, name, "b")
	checkView(t, name, last(2), "a", "b")
	require.NoError(t, b.Close()) // b's session ends: b leaves
	checkView(t, name, last(1), "a")
	vs := views()
	for i, v := range vs {
		require.NotNil(t, v.Resynced)
		require.False(t, *v.Resynced)
		if i > 0 {
			require.Greater(t, v.Revision, vs[i-1].Revision)
		}
	}

	// It may print b's join and leave as one view (the latest), if it
	// read late: a view after the first, at least.
	eventually(t, func() bool { return tables() >= 2 }, "2 views in a table, have %q", tw.stdout.String())
	blocks := strings.Split(strings.TrimSpace(tw.stdout.String()), "\n\n")
	first := strings.Split(blocks[0], "\n")
	rev, ok := strings.CutPrefix(first[0], "revision ")
	require.True(t, ok, "%q", blocks[0])
	_, err := strconv.ParseInt(rev, 10, 64)
	require.NoError(t, err, "%q", blocks[0])
	require.Equal(t, []string{"POS", "KEY", "REV", "LEASE", "VALUE"}, strings.Fields(first[1]))
	require.Len(t, first, 3, "%q", blocks[0])

	for _, p := range []*ctl{w, tw} {
		p.signal(t, syscall.SIGTERM)
		require.Equal(t, 0, p.wait(t))
		require.Empty(t, p.stderr.String())
	}
}

package etcdsync_test

// Inspection (Holders): who holds a name and who waits, per primitive, in
// queue order, by the rules the waiters follow.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync"
)

// seen is what a test compares of an Entry.
type seen struct {
	Key  string
	Held bool
	Kind string
	Val  string
}

func holdersOf(t *testing.T, cli *clientv3.Client, name string) []seen {
	t.Helper()
	es, err := etcdsync.Holders(ctxT(t), cli, name)
	require.NoError(t, err)
	var out []seen
	for _, e := range es {
		out = append(out, seen{e.Key, e.Held, e.Kind, string(e.Value)})
	}
	return out
}

// Keys written as each primitive writes them (and as etcdctl and etcd's
// recipes do) are listed in queue order, holders first, by each queue's
// rule; nested names' keys and other keys are not listed.
func TestHoldersByEachQueuesRule(t *testing.T) {
	t.Parallel()
	cli := kitSingle(t).Client(t)
	ctx := ctxT(t)
	put := func(kvs ...string) {
		for i := 0; i < len(kvs); i += 2 {
			_, err := cli.Put(ctx, kvs[i], kvs[i+1])
			require.NoError(t, err)
		}
	}
	put("m/1a", "", "m/1b", "", "m/x/1c", "", "m/not-hex", "", "m/1d", "")
	require.Equal(t, []seen{
		{"m/1a", true, "exclusive", ""},
		{"m/1b", false, "exclusive", ""},
		{"m/1d", false, "exclusive", ""},
	}, holdersOf(t, cli, "m"))

	put("s/2a", "2/3", "s/2b", "2/3", "s/2c", "1/3")
	require.Equal(t, []seen{
		{"s/2a", true, "semaphore", "2/3"},
		{"s/2b", false, "semaphore", "2/3"}, // 2+2 > 3
		{"s/2c", false, "semaphore", "1/3"}, // FIFO: no one passes a waiter
	}, holdersOf(t, cli, "s"))

	put("rw/read/3a", "", "rw/read/3b", "", "rw/write/3c", "", "rw/read/3d", "")
	require.Equal(t, []seen{
		{"rw/read/3a", true, "read", ""},
		{"rw/read/3b", true, "read", ""},
		{"rw/write/3c", false, "write", ""},
		{"rw/read/3d", false, "read", ""},
	}, holdersOf(t, cli, "rw"))

	require.Empty(t, holdersOf(t, cli, "nobody"))
	_, err := etcdsync.Holders(ctx, cli, "")
	require.ErrorIs(t, err, etcdsync.ErrInvalidName)
}

// Holders agrees with the primitives: the Mutex that holds is listed as
// held with its fencing token and lease, the one that waits behind it as
// waiting, and after the release the waiter holds.
func TestHoldersAgreesWithTheLock(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	a, b := session(t, c.Client(t)), session(t, c.Client(t))
	ma, mb := etcdsync.NewMutex(a, "agree"), etcdsync.NewMutex(b, "agree")
	require.NoError(t, ma.Lock(ctx))
	locked := make(chan error, 1)
	go func() { locked <- mb.Lock(ctx) }()
	awaitKeys(t, &deployment{admin: cli}, "agree", 2)
	es, err := etcdsync.Holders(ctx, cli, "agree")
	require.NoError(t, err)
	require.Len(t, es, 2)
	require.Equal(t, etcdsync.Entry{Key: ma.Key(), Rev: ma.Rev(), Lease: a.Lease(), Value: []byte{}, Held: true, Kind: "exclusive"}, withValue(es[0]))
	require.False(t, es[1].Held)
	require.Equal(t, b.Lease(), es[1].Lease)
	require.NoError(t, ma.Unlock(ctx))
	select {
	case err := <-locked:
		require.NoError(t, err)
	case <-time.After(testTimeout):
		t.Fatal("the waiter did not get the lock")
	}
	es, err = etcdsync.Holders(ctx, cli, "agree")
	require.NoError(t, err)
	require.Len(t, es, 1)
	require.True(t, es[0].Held)
	require.Equal(t, mb.Rev(), es[0].Rev)
	require.NoError(t, mb.Unlock(context.Background()))
}

// withValue makes an empty value compare equal however the client decoded it.
func withValue(e etcdsync.Entry) etcdsync.Entry {
	if e.Value == nil {
		e.Value = []byte{}
	}
	return e
}

package tests

// Inspection (Holders): who holds a name and who waits, per primitive, in
// queue order, by the rules the waiters follow.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"fmt"

	"github.com/etcdsync/etcdsync"
	"go.etcd.io/etcd/client/v3/concurrency"
	recipe "go.etcd.io/etcd/client/v3/experimental/recipes"
	"go.etcd.io/etcd/client/v3/namespace"
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
	c, cli, ctx := kitSingleClient(t)
	a, b := session(t, c.Client(t)), session(t, c.Client(t))
	ma, mb := etcdsync.NewMutex(a, "agree"), etcdsync.NewMutex(b, "agree")
	require.NoError(t, ma.Lock(ctx))
	locked := async(func() error { return mb.Lock(ctx) })
	waitCount(t, cli, "agree/", cellTimeout, func(n int) bool { return n >= 2 })
	es, err := etcdsync.Holders(ctx, cli, "agree")
	require.NoError(t, err)
	require.Len(t, es, 2)
	require.Equal(t, etcdsync.Entry{Key: ma.Key(), Rev: ma.Rev(), Lease: a.Lease(), Value: []byte{}, Held: true, Kind: "exclusive"}, withValue(es[0]))
	require.False(t, es[1].Held)
	require.Equal(t, b.Lease(), es[1].Lease)
	require.NoError(t, ma.Unlock(ctx))
	require.NoError(t, resultWithin(t, locked, testTimeout, "the waiter's Lock"))
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

// Holders on keys the library did not write: etcd's concurrency Mutex
// (NAME/<lease hex>, as etcdctl lock writes), a namespaced client, and a
// semaphore queue with a bad value mixed in.
func TestHoldersOfKeysOtherClientsWrote(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)

	t.Run("concurrency", func(t *testing.T) {
		var ss []*concurrency.Session
		for range 3 {
			ss = append(ss, theirSession(t, admin))
		}
		m0 := concurrency.NewMutex(ss[0], "insp-conc")
		require.NoError(t, m0.Lock(ctx))
		var wait []<-chan error
		for _, s := range ss[1:] {
			m := concurrency.NewMutex(s, "insp-conc")
			wait = append(wait, async(func() error { return m.Lock(ctx) }))
			waitKeys(t, admin, "insp-conc/", len(wait)+1)
		}
		es, err := etcdsync.Holders(ctx, admin, "insp-conc")
		require.NoError(t, err)
		require.Len(t, es, 3)
		require.Equal(t, m0.Key(), es[0].Key)
		require.True(t, es[0].Held)
		require.Equal(t, "exclusive", es[0].Kind)
		require.False(t, es[1].Held)
		require.False(t, es[2].Held)
		require.Equal(t, clientv3.LeaseID(ss[0].Lease()), es[0].Lease)
		// And the library's own Mutex behind them waits for them all.
		lm := etcdsync.NewMutex(session(t, admin), "insp-conc")
		l := async(func() error { return lm.Lock(ctx) })
		waitKeys(t, admin, "insp-conc/", 4) // its key is queued before m0 goes
		require.NoError(t, m0.Unlock(ctx))
		require.NoError(t, resultWithin(t, wait[0], testTimeout, "second"))
		es, err = etcdsync.Holders(ctx, admin, "insp-conc")
		require.NoError(t, err)
		require.Len(t, es, 3)
		require.True(t, es[0].Held)
		require.False(t, es[1].Held)
		require.False(t, es[2].Held)
		notYet(t, l, 200*time.Millisecond, "the library's Mutex behind etcd's")
		for _, s := range ss[1:] {
			s.Close()
		}
		require.NoError(t, resultWithin(t, l, testTimeout, "the library's Mutex"))
		require.NoError(t, lm.Unlock(ctx))
		<-wait[1]
	})

	t.Run("recipe-rwmutex", func(t *testing.T) {
		const name = "insp-rw"
		w := recipe.NewRWMutex(theirSession(t, admin), name)
		require.NoError(t, w.Lock()) // name/write/<decimal>
		lib := etcdsync.NewRWMutex(session(t, admin), name)
		r := async(func() error { return lib.RLock(ctx) })
		waitKeys(t, admin, name+"/", 2)
		lw := etcdsync.NewRWMutex(session(t, admin), name)
		wl := async(func() error { return lw.Lock(ctx) })
		waitKeys(t, admin, name+"/", 3)
		es, err := etcdsync.Holders(ctx, admin, name)
		require.NoError(t, err)
		t.Logf("%+v", es)
		require.Len(t, es, 3)
		require.Equal(t, []bool{true, false, false}, []bool{es[0].Held, es[1].Held, es[2].Held})
		require.Equal(t, []string{"write", "read", "write"}, []string{es[0].Kind, es[1].Kind, es[2].Kind})
		notYet(t, r, 200*time.Millisecond, "the library's reader behind the recipe's writer")
		require.NoError(t, w.Unlock())
		require.NoError(t, resultWithin(t, r, testTimeout, "reader"))
		es, err = etcdsync.Holders(ctx, admin, name)
		require.NoError(t, err)
		require.Len(t, es, 2)
		require.True(t, es[0].Held)
		require.False(t, es[1].Held)
		require.NoError(t, lib.RUnlock(ctx))
		require.NoError(t, resultWithin(t, wl, testTimeout, "writer"))
		require.NoError(t, lw.Unlock(ctx))
	})

	t.Run("namespace", func(t *testing.T) {
		cli := c.Client(t)
		cli.KV = namespace.NewKV(cli.KV, "tenant25/")
		cli.Watcher = namespace.NewWatcher(cli.Watcher, "tenant25/")
		cli.Lease = namespace.NewLease(cli.Lease, "tenant25/")
		m1 := etcdsync.NewMutex(session(t, cli), "ns")
		m2 := etcdsync.NewMutex(session(t, cli), "ns")
		require.NoError(t, m1.Lock(ctx))
		w := async(func() error { return m2.Lock(ctx) })
		waitKeys(t, admin, "tenant25/ns/", 2)
		es, err := etcdsync.Holders(ctx, cli, "ns")
		require.NoError(t, err)
		require.Len(t, es, 2)
		require.Equal(t, m1.Key(), es[0].Key)
		require.True(t, es[0].Held)
		require.False(t, es[1].Held)
		require.NoError(t, m1.Unlock(ctx))
		require.NoError(t, resultWithin(t, w, testTimeout, "m2"))
		require.NoError(t, m2.Unlock(ctx))
	})

	t.Run("semaphore-bad-value", func(t *testing.T) {
		const name = "insp-badsem"
		s1 := etcdsync.NewSemaphore(session(t, admin), name, 3)
		require.NoError(t, s1.Acquire(ctx, 2))
		lease, err := admin.Grant(ctx, 30)
		require.NoError(t, err)
		_, err = admin.Put(ctx, fmt.Sprintf("%s/%x", name, int64(lease.ID)), "garbage", clientv3.WithLease(lease.ID))
		require.NoError(t, err)
		es, err := etcdsync.Holders(ctx, admin, name)
		require.NoError(t, err)
		require.Len(t, es, 2)
		t.Logf("with a bad value: %+v", es)
		// A Semaphore waiter on the name fails with ErrInvalidArgument.
		s2 := etcdsync.NewSemaphore(session(t, admin), name, 3)
		err = s2.Acquire(ctx, 1)
		require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
		_, err = admin.Revoke(ctx, lease.ID)
		require.NoError(t, err)
		require.NoError(t, s1.Release(ctx))
		waitNoKeys(t, admin, name+"/")
	})
}

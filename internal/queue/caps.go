package queue

// What the library learns about the servers behind a client (type caps):
// whether its serializable reads come back behind the revision a waiter
// must reach (etcd's gRPC proxy answers them from a cache that deletes made
// elsewhere, and lease expiry, do not invalidate; a lagging member does
// too, for a moment), so that its waiters read linearizably at once for a
// while rather than first serializably for nothing.

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// caps is what the library has learned about the servers behind one
// client.
type caps struct {
	// linearUntil is when, UnixNano, a serializable read seen behind stops
	// counting: until then the client's waiters read linearizably at once.
	linearUntil atomic.Int64
}

// behindFor is how long a serializable read seen behind makes a client's
// waiters read linearizably at once.
const behindFor = time.Minute

// clientCaps maps a client (weakly: it does not keep the client alive) to
// its caps.
var clientCaps sync.Map // weak.Pointer[clientv3.Client] -> *caps

// capsOf returns cli's caps, made on first use and dropped when cli is
// garbage.
func capsOf(cli *clientv3.Client) *caps {
	k := weak.Make(cli)
	if c, ok := clientCaps.Load(k); ok {
		return c.(*caps)
	}
	c, loaded := clientCaps.LoadOrStore(k, &caps{})
	if !loaded {
		runtime.AddCleanup(cli, func(k weak.Pointer[clientv3.Client]) { clientCaps.Delete(k) }, k)
	}
	return c.(*caps)
}

// behind records that a serializable read on the client came back behind
// the revision it had to reach.
func (c *caps) behind() { c.linearUntil.Store(time.Now().Add(behindFor).UnixNano()) }

// cached reports whether a serializable read on the client came back
// behind within behindFor: its waiters then read linearizably at once (a
// serializable read would mostly be behind again, through etcd's gRPC
// proxy always, and a linearizable read right away saves a round trip).
func (c *caps) cached() bool { return time.Now().UnixNano() < c.linearUntil.Load() }

package etcdsync

// HoldFrom: the hold a Run's context carries (internal/queue/run.go keeps
// the Runs' contexts).

import (
	"context"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// HoldFrom returns the innermost hold that ctx carries (the context a Run
// hands to its fn, or one derived from it): its key and fencing token (the
// key's create revision), to pass along with fn's writes to other systems.
// ok is false when ctx carries none. It does not touch etcd; the hold may
// have ended since (then fn's context has ended too).
func HoldFrom(ctx context.Context) (key string, rev int64, ok bool) {
	return queue.HoldFrom(ctx)
}

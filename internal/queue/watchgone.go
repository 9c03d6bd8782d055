package queue

// The watch of one key's incarnation until it is gone (WatchGone): a
// hold's loss watch (Hold.watchKey) and a Barrier's wait for its key.

import (
	"context"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// WatchGone blocks until the incarnation of key created at rev is gone
// (deleted, or deleted and created again), watching from revision from (the
// key was there at from-1), and returns the revision at which it was seen
// gone. It keeps one watch; when the watch fails (compaction, a member
// restart, a lost leader) it reads the key once (linearizable) and watches
// again from that read, so it survives them. It returns ctx's error when ctx
// ends, and an error when the client is closed.
func WatchGone(ctx context.Context, cli *clientv3.Client, key string, rev, from int64) (int64, error) {
	for {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range cli.Watch(wctx, key, clientv3.WithRev(from), clientv3.WithFilterPut()) {
			if wr.Canceled {
				break
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					cancel()
					return ev.Kv.ModRevision, nil
				}
			}
			from = max(from, wr.Header.Revision+1)
		}
		cancel()
		if err := Pause(ctx); err != nil {
			return 0, err
		}
		resp, err := cli.Get(ctx, key)
		switch {
		case err != nil && cli.Ctx().Err() != nil:
			return 0, fmt.Errorf("etcdsync: watch %s: client closed: %w", key, err)
		case err != nil:
		case len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != rev:
			return resp.Header.Revision, nil
		default:
			from = resp.Header.Revision + 1
		}
	}
}

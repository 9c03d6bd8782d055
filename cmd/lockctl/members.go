//go:build unix

package main

// lockctl members: a Group's members at one revision, or (--watch) a view
// after each change, as the library's GroupMembers and WatchGroup give them.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/etcdsync/etcdsync"
	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// newMembersCmd is "lockctl members".
func newMembersCmd(conn *connFlags) *cobra.Command {
	var output string
	var watch bool
	cmd := &cobra.Command{
		Use:   "members [flags] NAME",
		Short: "List the members of the group NAME in join order; --watch follows them",
		Long: `List the members of the group NAME (an etcdsync Group) in join order, with
each member's key, create revision, lease and value, exactly as they were at
one revision: one linearizable read, bounded by --dial-timeout. Every direct
child NAME/<id> is a member; keys of nested names (NAME/x/...) are not.

-o json prints one object: {"revision": R, "members": [...]}.

--watch prints the members at once, then again after each change (a join, a
leave, a new value), each view exact at its revision, from one watch. A view
after the history it needed was compacted comes from a new read and says
"resynced". In a table each view opens with "revision R" (and "resynced");
with -o json each view is one line, its object with "resynced". It runs
until SIGINT or SIGTERM (exit 0); etcd unreachable at start is exit 1, and
later outages are waited out.`,
		Example: `  lockctl members render-pool
  lockctl members -o json render-pool | jq -r '.members[].value'
  lockctl members --watch -o json render-pool`,
		Args: cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usage(fmt.Errorf("want NAME, got %d argument(s) (see '%s --help')", len(args), cmd.CommandPath()))
			}
			if output != "table" && output != "json" {
				return usage(fmt.Errorf("-o %q: want table or json", output))
			}
			if err := checkName(cmd, args[0]); err != nil {
				return err
			}
			if watch {
				return watchMembers(conn, args[0], output, cmd.OutOrStdout())
			}
			return members(conn, args[0], output, cmd.OutOrStdout())
		}),
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	cmd.Flags().BoolVarP(&watch, "watch", "w", false, "print the members again after each change, until SIGINT or SIGTERM")
	return cmd
}

// view is the members of a group at one revision, as printed.
type view struct {
	Revision int64    `json:"revision"`
	Resynced *bool    `json:"resynced,omitempty"` // --watch only
	Members  []member `json:"members"`
}

// member is one member of a group.
type member struct {
	Position       int    `json:"position"` // in join order, from 1
	Key            string `json:"key"`
	CreateRevision int64  `json:"create_revision"`
	Lease          string `json:"lease"` // hex, "" for a key without a lease
	Value          string `json:"value"`
}

// viewOf is v as printed; resynced only for --watch.
func viewOf(rev int64, es []etcdsync.Entry, resynced *bool) view {
	out := view{Revision: rev, Resynced: resynced, Members: []member{}}
	for i, e := range es {
		m := member{Position: i + 1, Key: e.Key, CreateRevision: e.Rev, Value: string(e.Value)}
		if e.Lease != clientv3.NoLease {
			m.Lease = strconv.FormatInt(int64(e.Lease), 16)
		}
		out.Members = append(out.Members, m)
	}
	return out
}

// members prints name's members to out. It blocks for one read after the
// connection's check, bounded by --dial-timeout.
func members(cf *connFlags, name, output string, out io.Writer) error {
	cli, err := cf.dial(context.Background(), name+"/")
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), cf.dialTimeout)
	es, rev, err := etcdsync.GroupMembers(ctx, cli, name)
	cancel()
	if err != nil {
		return err
	}
	v := viewOf(rev, es, nil)
	if output == "json" {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	return printTable(out, v)
}

// watchMembers prints name's members, then a view after each change, to
// out until a signal arrives. Connecting is bounded by --dial-timeout (etcd
// unreachable at start is an error); later outages are waited out. It joins
// the watch's goroutines before returning.
func watchMembers(cf *connFlags, name, output string, out io.Writer) error {
	sigs, stopSignals := notifySignals()
	defer stopSignals()
	cli, err := cf.dial(context.Background(), name+"/")
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithCancel(context.Background())
	views, err := etcdsync.WatchGroup(ctx, cli, name)
	if err != nil {
		cancel()
		return err
	}
	defer func() {
		cancel()
		for range views { // the watch's goroutines end with ctx
		}
	}()
	enc := json.NewEncoder(out)
	for {
		select {
		case <-sigs:
			return nil
		case gv, ok := <-views:
			if !ok {
				return fmt.Errorf("watch the members of %s: the watch ended", name)
			}
			v := viewOf(gv.Rev, gv.Members, &gv.Resynced)
			if output == "json" {
				if err := enc.Encode(v); err != nil {
					return err
				}
				continue
			}
			head := fmt.Sprintf("revision %d", v.Revision)
			if gv.Resynced {
				head += " resynced"
			}
			fmt.Fprintln(out, head)
			if err := printTable(out, v); err != nil {
				return err
			}
			fmt.Fprintln(out)
		}
	}
}

// printTable prints v's members as a table, a header first.
func printTable(out io.Writer, v view) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POS\tKEY\tREV\tLEASE\tVALUE")
	for _, m := range v.Members {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\n", m.Position, m.Key, m.CreateRevision, m.Lease, strconv.Quote(m.Value))
	}
	return tw.Flush()
}
